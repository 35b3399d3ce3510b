"""SmolLM3 (NoPE layers: 1 and 3 of the tiny model's 4) through the whole engine: the family tests of
test_llm_phi3_qwen3_moe.py, run here on a tiny random-weight SmolLM3 checkpoint (their `case` fixture is this
module's). Tokens and logprobs equal transformers' float32 model, teacher-forced, through one-step and chunked
prefill, prefix caching, preemption and recomputation, n > 1, and two tensor-parallel ranks or pipeline stages (a
NoPE layer on each stage). A second checkpoint slides its NoPE layers' attention over 16 tokens, as transformers
does where use_sliding_window is set, so prompts longer than the window test the sliding layers' cache."""
from __future__ import annotations

import pytest
import torch
from test_llm_phi3_qwen3_moe import (  # noqa: F401 - pytest collects these tests and the prompts fixture here
    prompts,
    test_cached_prefix_and_preemption,
    test_greedy_matches_transformers,
    test_n_sampled_sequences_each_match,
    test_two_ranks,
)

KINDS = {"smollm3": {}, "smollm3-sliding-nope": dict(use_sliding_window=True, sliding_window=16)}


@pytest.fixture(scope="module", params=KINDS)
def case(request, tiny_model_factory):
    """(model dir, transformers' float32 model of it), one per checkpoint."""
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_factory("smollm3", **KINDS[request.param])
    return model_dir, AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
