"""LoRA rows in the fused CPU decode step (kernels/decoder_cpu.c adds each row's delta after the packed matmuls)
against the module-by-module PyTorch path on the same weights and adapters: a batch mixing the base model and two
adapters of different ranks and targets, float32 and int8-packed weights, and adapters evicted and loaded into
reused slots between runs. The module path itself is checked against PEFT's merged model in test_lora_generate.py."""
from __future__ import annotations

import pytest

from pagellm import LLM, SamplingParams
from pagellm.kernels.decoder import FusedDecoder
from pagellm.lora import LoRARequest
from pagellm.model_executor.models.llama import LlamaForCausalLM

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, logprobs=3, ignore_eos=True)


def model_of(llm: LLM):
    return llm.llm_engine.engine_core.executor.collective_rpc("__getattribute__", "model_runner")[0].model


def generate(model_dir, quantization: str, fused: bool, runs, monkeypatch, max_loras: int = 2) -> list:
    monkeypatch.setattr(LlamaForCausalLM, "use_fused_decoder", fused)
    llm = LLM(model=str(model_dir), max_model_len=128, kv_cache_memory_bytes=4 << 20, quantization=quantization,
              enable_lora=True, max_loras=max_loras, max_lora_rank=8)
    outputs = [llm.generate(prompts, PARAMS, lora_request=loras, use_tqdm=False) for prompts, loras in runs]
    assert isinstance(model_of(llm).fused_step.decoder, FusedDecoder) is fused
    return [output for run in outputs for output in run]


def assert_same(fused: list, modules: list) -> None:
    for a, b in zip(fused, modules, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for entry_a, entry_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            for token, logprob in entry_b.items():
                assert entry_a[token].logprob == pytest.approx(logprob.logprob, abs=1e-4)


@pytest.fixture(scope="module")
def adapters(tiny_model_factory, peft_adapter_factory):
    model_dir = tiny_model_factory("qwen2")  # biases on q/k/v: the delta goes in before them
    return model_dir, [
        peft_adapter_factory(model_dir, seed=1, rank=8, alpha=16),
        peft_adapter_factory(model_dir, seed=2, rank=4, alpha=8, target_modules=("q_proj", "v_proj", "down_proj"),
                             use_rslora=True),
        peft_adapter_factory(model_dir, seed=3, rank=2, alpha=4, target_modules=("k_proj", "o_proj", "up_proj"))]


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_mixed_batch_matches_module_path(quantization, adapters, make_token_prompts, monkeypatch, lora_rows_seen):
    model_dir, paths = adapters
    prompts = make_token_prompts([5, 23, 9, 17, 12, 30], seed=3)
    loras = [None, LoRARequest("one", 1, str(paths[0])), LoRARequest("two", 2, str(paths[1]))] * 2
    fused = generate(model_dir, quantization, True, [(prompts, loras)], monkeypatch)
    # Every decode step ran in C with its rows' slots (0 and 1: the adapters in the order first seen), the base
    # model's rows unchanged there.
    assert lora_rows_seen and all(sorted(rows) == [-1, -1, 0, 0, 1, 1] for rows in lora_rows_seen)
    assert_same(fused, generate(model_dir, quantization, False, [(prompts, loras)], monkeypatch))


def test_slots_reused_after_eviction(adapters, make_token_prompts, monkeypatch, lora_rows_seen):
    """With room for one adapter, each run evicts the last one's and loads its own into the freed slot: the C side
    must follow (a stale slot would add the old adapter's deltas)."""
    model_dir, paths = adapters
    prompts = make_token_prompts([7, 19], seed=5)
    runs = [(prompts, [LoRARequest(f"a{i}", i + 1, str(path)), None]) for i, path in enumerate(paths)]
    runs.append((prompts, [None, LoRARequest("a0", 1, str(paths[0]))]))
    fused = generate(model_dir, "none", True, runs, monkeypatch, max_loras=1)
    assert {tuple(rows) for rows in lora_rows_seen} == {(0, -1), (-1, 0)}  # one slot, reused by every adapter
    modules = generate(model_dir, "none", False, runs, monkeypatch, max_loras=1)
    assert_same(fused, modules)
    # The adapters differ: the comparison above would see a stale slot.
    assert len({tuple(output.outputs[0].token_ids) for output in modules[0:6:2]}) == 3
