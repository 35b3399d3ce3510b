"""LoRA adapters through the offline LLM, against transformers running PEFT's merged model (`merge_and_unload()`),
greedy and token-exact in float32: one adapter, a batch mixing the base model and two adapters, prefix caching
with two adapters on one prompt. Decode steps run the fused CPU decode step, adapter rows included."""
from __future__ import annotations

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.lora import LoRARequest
from tests.entrypoints.conftest import assert_no_leaked_blocks, hf_greedy_generate

MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def adapters(model_dir, peft_adapter_factory):
    """Adapter 1 on every projection; adapter 2 on q/v and down only, rsLoRA, another rank."""
    return (peft_adapter_factory(model_dir, seed=1, rank=8, alpha=16),
            peft_adapter_factory(model_dir, seed=2, rank=4, alpha=8, target_modules=("q_proj", "v_proj", "down_proj"),
                                 use_rslora=True))


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model=str(model_dir), enable_lora=True, max_loras=2, max_lora_rank=8, max_model_len=256,
               kv_cache_memory_bytes=1 << 22)


def merged_greedy(model_dir, adapter, prompts: list[list[int]]) -> list[list[int]]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    return [hf_greedy_generate(model.eval(), prompt, MAX_TOKENS) for prompt in prompts]


def test_mixed_batch_matches_each_merged_model(llm, model_dir, adapters, make_token_prompts, lora_rows_seen):
    prompts = make_token_prompts([5, 23, 9, 17, 12, 30])
    loras = [None, LoRARequest("one", 1, str(adapters[0])), LoRARequest("two", 2, str(adapters[1]))] * 2
    outputs = llm.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False)
    ids = [p["prompt_token_ids"] for p in prompts]
    expected = {None: merged_greedy(model_dir, None, ids[0::3]), 1: merged_greedy(model_dir, adapters[0], ids[1::3]),
                2: merged_greedy(model_dir, adapters[1], ids[2::3])}
    for i, output in enumerate(outputs):
        lora = loras[i]
        assert output.outputs[0].token_ids == expected[lora.lora_int_id if lora else None][i // 3], i
    assert lora_rows_seen, "the decode steps ran the fused C step with the adapters' rows"
    # The adapters change the output: the comparison above could fail.
    assert expected[1] != expected[None][:len(expected[1])] or expected[2] != expected[None]
    assert_no_leaked_blocks(llm)


def test_prefix_caching_never_shares_blocks_across_adapters(llm, model_dir, adapters, make_token_prompts):
    prompt = make_token_prompts([40], seed=7)[0]
    one, two = LoRARequest("one", 1, str(adapters[0])), LoRARequest("two", 2, str(adapters[1]))
    runs = [llm.generate([prompt], GREEDY, lora_request=lora, use_tqdm=False)[0] for lora in (one, two, one, None)]
    # Nothing cached for the second adapter or the base model; the first adapter's second run reuses its blocks.
    assert [run.num_cached_tokens for run in runs] == [0, 0, 32, 0]
    ids = [prompt["prompt_token_ids"]]
    assert runs[0].outputs[0].token_ids == runs[2].outputs[0].token_ids == merged_greedy(model_dir, adapters[0], ids)[0]
    assert runs[1].outputs[0].token_ids == merged_greedy(model_dir, adapters[1], ids)[0]
    assert runs[3].outputs[0].token_ids == merged_greedy(model_dir, None, ids)[0]
    assert_no_leaked_blocks(llm)


def test_lora_request_needs_enable_lora(model_dir, adapters):
    llm = LLM(model=str(model_dir), max_model_len=64, kv_cache_memory_bytes=1 << 20)
    with pytest.raises(ValueError, match="--enable-lora"):
        llm.generate(["hi"], GREEDY, lora_request=LoRARequest("one", 1, str(adapters[0])), use_tqdm=False)
