"""Gemma 3 270M's real weights with their KV cache groups: 3 global layers in one full-attention group, 15 local
layers (512-token window) in five sliding groups, a block being three layers' page. An 8,000-token conversation
runs in a pool of 1,000 pages, where every token in every layer would need 3,000: the local layers' blocks are
freed as they leave the window, and the generated tokens' logprobs are transformers' float32 ones over the same
file.

Kept within a minute or two on two cores: the engine loads the file's matrices as float32 (as transformers does; the
packed Q4_K path has its own tests in test_gemma3.py) and prefills in 1,024-token chunks; transformers runs the same
8,000 tokens through its own chunked prefill (a sliding-window cache for the local layers, so their attention reads
the window, not the whole conversation) and computes logits only at the generated positions. Measured: within
1.2e-7 of transformers. One transformers forward pass over all 8,000 tokens instead takes minutes; chunking changes
only the order of float32 sums (~4e-5 apart from one pass, measured at 1,500 tokens), hence the 1e-4 tolerance.
About 130 CPU-seconds in all (a minute on an idle two-core host; several when other work shares it).
"""
from __future__ import annotations

import torch

from pagellm import LLM, SamplingParams
from pagellm.kernels.decoder import FusedDecoder

BLOCK_SIZE = 16
NUM_PAGES = 1000
CHUNK = 1024
NEW_TOKENS = 8
NUM_TOKENS = 8000


def conversation(tokenizer) -> list[int]:
    turns = [f"User: what is {i} plus {i}?\nModel: {i} plus {i} is {2 * i}.\n" for i in range(1200)]
    prompt = tokenizer("".join(turns))["input_ids"][:NUM_TOKENS - NEW_TOKENS]
    assert len(prompt) == NUM_TOKENS - NEW_TOKENS
    return prompt


def transformers_logprobs(model, token_ids: list[int], num_last: int) -> torch.Tensor:
    """log-softmax of transformers' logits at the last `num_last` positions, its prefill chunked through its own
    cache (DynamicCache from the config: a sliding-window layer for each local layer)."""
    from transformers import DynamicCache

    ids = torch.tensor([token_ids])
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        for start in range(0, len(token_ids), CHUNK):
            logits = model(ids[:, start:start + CHUNK], cache=cache, use_cache=True, logits_to_keep=num_last).logits
    return logits[0].float().log_softmax(-1)


def test_8000_token_conversation_in_a_third_of_the_full_attention_pool(gemma3_gguf, gemma3_reference):
    page = 2 * 3 * BLOCK_SIZE * 1 * 256 * 4  # K and V, 3 layers, 1 KV head of 256 dims, float32
    llm = LLM(model=str(gemma3_gguf), quantization="none", max_model_len=NUM_TOKENS, block_size=BLOCK_SIZE,
              max_num_batched_tokens=CHUNK, kv_cache_memory_bytes=NUM_PAGES * page)
    core = llm.llm_engine.engine_core
    manager = core.kv_cache_manager
    assert [g.window for g in manager.groups] == [None] + [512] * 5
    assert core.num_blocks == NUM_PAGES
    blocks_per_layer = -(-NUM_TOKENS // BLOCK_SIZE)
    assert 6 * blocks_per_layer == 3 * NUM_PAGES, "every token in every layer: three times the pool"
    prompt = conversation(llm.get_tokenizer())
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=0, ignore_eos=True)
    (output,) = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    stats = core.scheduler.stats()
    assert stats.num_preemptions_total == 0 and stats.num_swapped_in_blocks_total == 0
    # The full group held its 500 blocks, so the five sliding groups ran in the other 500 pages instead of 2,500:
    # at least 2,000 of their blocks were freed as they left the window.
    assert manager.num_window_freed_blocks >= 5 * blocks_per_layer - (NUM_PAGES - blocks_per_layer)
    tokens = list(output.outputs[0].token_ids)
    assert len(prompt) + len(tokens) == NUM_TOKENS
    expected = transformers_logprobs(gemma3_reference, prompt + tokens, NEW_TOKENS + 1)[:-1]
    ours = torch.tensor([entry[t].logprob for entry, t in zip(output.outputs[0].logprobs, tokens)])
    torch.testing.assert_close(ours, expected.gather(1, torch.tensor(tokens)[:, None])[:, 0], rtol=0, atol=1e-4)
    assert tokens == expected.argmax(-1).tolist(), "greedy: transformers' most likely token at every step"
    model = core.executor.collective_rpc("__getattribute__", "model_runner")[0].model
    assert isinstance(model.fused_decoder(), FusedDecoder), "the decode steps ran the fused C step, per group"
    core.scheduler.check_consistency()
    llm.shutdown()
