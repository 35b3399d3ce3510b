"""Gemma 3 270M's real Q4_K_M file with its KV cache groups: 3 global layers in one full-attention group, 15 local
layers (512-token window) in five sliding groups, a block being three layers' page. A 1,100-token conversation plus
its answer runs in a pool too small to keep every token in every layer, the local layers' blocks freed as they
leave the window, and gives transformers' float32 logprobs (teacher-forced, same file) at every generated token.

An 8,000-token conversation (7,950 prompt tokens, 40 generated) was checked the same way by hand in a 900-page pool
(every token in every layer: 3,000 pages): logprobs within 2.4e-7 of transformers, 2,335 blocks freed; it takes
minutes on two cores (transformers' forward alone), too long for the suite (docs/features.md).
"""
from __future__ import annotations

import torch

from pagellm import LLM, SamplingParams
from pagellm.kernels.decoder import FusedDecoder

BLOCK_SIZE = 16
NEW_TOKENS = 16


def test_conversation_past_the_window_in_a_pool_too_small_for_full_attention(gemma3_gguf, gemma3_reference):
    page = 2 * 3 * BLOCK_SIZE * 1 * 256 * 4  # K and V, 3 layers, 1 KV head of 256 dims, float32
    llm = LLM(model=str(gemma3_gguf), max_model_len=1120, block_size=BLOCK_SIZE, max_num_batched_tokens=256,
              kv_cache_memory_bytes=320 * page)
    core = llm.llm_engine.engine_core
    assert [g.window for g in core.kv_cache_manager.groups] == [None] + [512] * 5
    assert core.num_blocks == 320
    tokenizer = llm.get_tokenizer()
    turns = [f"User: what is {i} plus {i}?\nModel: {i} plus {i} is {2 * i}.\n" for i in range(200)]
    prompt = tokenizer("".join(turns))["input_ids"][:1100]
    num_tokens = len(prompt) + NEW_TOKENS
    assert 6 * -(-num_tokens // BLOCK_SIZE) > core.num_blocks, "every token in every layer would not fit"
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=0, ignore_eos=True)
    (output,) = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    assert core.kv_cache_manager.num_window_freed_blocks > 0 and core.scheduler.num_preemptions_total == 0
    tokens = list(output.outputs[0].token_ids)
    with torch.inference_mode():
        logits = gemma3_reference(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    expected = logits.float().log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
    ours = torch.tensor([entry[t].logprob for entry, t in zip(output.outputs[0].logprobs, tokens)])
    torch.testing.assert_close(ours, expected, rtol=0, atol=2e-3)
    model = core.executor.collective_rpc("__getattribute__", "model_runner")[0].model
    assert isinstance(model.fused_decoder(), FusedDecoder), "the decode steps ran the fused C step, per group"
    core.scheduler.check_consistency()
    llm.shutdown()
