"""Bad adapters are refused with a ValueError naming the problem, before anything is queued (offline) and without
disturbing what is loaded: a missing file, a rank above --max-lora-rank, an unsupported target module, another
base model's shapes or layer count; and the registry's limits (--max-loras, names, ids)."""
from __future__ import annotations

import json
import shutil

import pytest

from pagellm import LLM, SamplingParams
from pagellm.lora import LoRARequest

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def adapter(model_dir, peft_adapter_factory):
    return peft_adapter_factory(model_dir, seed=1, rank=8)


@pytest.fixture(scope="module")
def llm(model_dir, adapter):
    return LLM(model=str(model_dir), enable_lora=True, max_loras=2, max_lora_rank=8, max_model_len=64,
               kv_cache_memory_bytes=1 << 20, lora_modules=[f"served={adapter}"])


def _edited_config(tmp_path, adapter, **changes):
    path = tmp_path / "edited"
    shutil.copytree(adapter, path)
    config = json.loads((path / "adapter_config.json").read_text())
    config.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def _refused(llm, path, match, lora_int_id=50):
    with pytest.raises(ValueError, match=match):
        llm.generate(["hi"], GREEDY, lora_request=LoRARequest("bad", lora_int_id, str(path)), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_missing_files_are_refused(llm, adapter, tmp_path):
    _refused(llm, tmp_path / "nowhere", "adapter_config.json is missing")
    path = tmp_path / "config-only"
    path.mkdir()
    shutil.copy(adapter / "adapter_config.json", path)
    _refused(llm, path, "adapter_model.safetensors is missing")


def test_rank_above_max_lora_rank(llm, model_dir, peft_adapter_factory):
    _refused(llm, peft_adapter_factory(model_dir, seed=3, rank=16), r"r=16 is above --max-lora-rank 8")


def test_unsupported_target_module(llm, adapter, tmp_path):
    _refused(llm, _edited_config(tmp_path, adapter, target_modules=["q_proj", "lm_head"]), "lm_head not supported")
    _refused(llm, _edited_config(tmp_path / "dora", adapter, use_dora=True), "use_dora")


def test_adapter_of_another_base_model(llm, tiny_model_factory, peft_adapter_factory):
    wider = tiny_model_factory("llama", hidden_size=96)
    _refused(llm, peft_adapter_factory(wider, seed=1), "made for another base model")
    deeper = tiny_model_factory("llama", num_hidden_layers=3)
    _refused(llm, peft_adapter_factory(deeper, seed=1), "this model has no such layer")


def test_one_id_one_adapter(llm, adapter, model_dir, peft_adapter_factory):
    llm.generate(["hi"], GREEDY, lora_request=LoRARequest("a", 7, str(adapter)), use_tqdm=False)
    other = peft_adapter_factory(model_dir, seed=4, rank=4)
    _refused(llm, other, "lora_int_id 7 already names", lora_int_id=7)


def test_registry_limits_and_names(llm, adapter, model_dir, peft_adapter_factory):
    loras = llm.llm_engine.input_processor.loras
    assert [lora.lora_name for lora in loras.named()] == ["served"]
    with pytest.raises(ValueError, match="already served"):
        loras.load("served", str(adapter))
    with pytest.raises(ValueError, match="above --max-lora-rank"):
        loras.load("big", str(peft_adapter_factory(model_dir, seed=3, rank=16)))
    assert [lora.lora_name for lora in loras.named()] == ["served"]  # nothing disturbed
    loras.load("second", str(adapter))
    with pytest.raises(ValueError, match=r"--max-loras \(2\)"):
        loras.load("third", str(adapter))
    loras.unload("second")
    with pytest.raises(KeyError):
        loras.unload("second")


def test_lora_modules_need_enable_lora(model_dir, adapter):
    with pytest.raises(ValueError, match="needs --enable-lora"):
        LLM(model=str(model_dir), lora_modules=[f"a={adapter}"], max_model_len=64, kv_cache_memory_bytes=1 << 20)
