"""Gemma 3 270M's real Q4_K_M file through the engine (its matrices packed, float32 activations) against
transformers' float32 model of the same file: greedy completions of plain prompts (a base model: no chat
template) token for token, one prompt longer than the 512-token window, teacher-forced logprobs; and the Gemma
layers (GeGLU, the (1 + w) norm in a lower precision) against transformers' own."""
from __future__ import annotations

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.model_executor.layers.activation import GeluAndMul
from pagellm.model_executor.layers.layernorm import GemmaRMSNorm

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "The three primary colors are"]
# Counting from 1 to 160, a token per digit: past the 512-token window of the local layers (the global ones see all).
LONG_PROMPT = "Counting: " + ", ".join(str(i) for i in range(1, 161)) + ","
NEW_TOKENS = 16
NEAR_TIE = 0.02


@pytest.fixture(scope="module")
def gemma3_llm(gemma3_gguf):
    llm = LLM(model=str(gemma3_gguf), max_model_len=1024, kv_cache_memory_bytes=64 << 20,
              max_num_batched_tokens=256)
    yield llm
    llm.shutdown()


def test_greedy_completions_equal_transformers(gemma3_llm, gemma3_reference):
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=0, ignore_eos=True)
    outputs = gemma3_llm.generate(PROMPTS + [LONG_PROMPT], params, use_tqdm=False)
    assert len(outputs[-1].prompt_token_ids) > 512 + NEW_TOKENS
    assert gemma3_llm.llm_engine.config.model_config.quantization == "gguf"
    for output in outputs:
        prompt, tokens = output.prompt_token_ids, output.outputs[0].token_ids
        with torch.inference_mode():
            logits = gemma3_reference(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
        reference = logits.float().log_softmax(-1)
        expected = reference.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        ours = torch.tensor([entry[t].logprob for entry, t in zip(output.outputs[0].logprobs, tokens)])
        torch.testing.assert_close(ours, expected, rtol=0, atol=2e-3, msg=f"{len(prompt)}-token prompt")
        margins = reference.max(-1).values - expected
        assert (margins < NEAR_TIE).all(), (output.prompt, margins)
        # Free-running transformers gives the same tokens wherever no near-tie was crossed.
        if (margins == 0).all():
            with torch.inference_mode():
                generated = gemma3_reference.generate(torch.tensor([prompt]), do_sample=False,
                                                      max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
            assert generated[0, len(prompt):].tolist() == tokens, output.prompt
    assert outputs[0].outputs[0].text.split()[:4] == ["the", "capital", "of", "the"] or "Paris" in \
        outputs[0].outputs[0].text
    assert outputs[-1].outputs[0].text.startswith(" 161, 162")


def test_gelu_and_mul_is_gemmas_mlp_activation():
    from transformers.activations import ACT2FN

    x = torch.randn(5, 2 * 24) * 3
    gate, up = x.chunk(2, dim=-1)
    exact = ACT2FN["gelu_pytorch_tanh"](gate.double()) * up.double()
    # The C kernel (float32 CPU) computes the same function as the sigmoid it equals: within float32 rounding of
    # the float64 result, as close as PyTorch's own float32 is; the PyTorch path (other dtypes) is transformers' own.
    ours, theirs = GeluAndMul()(x).double(), (ACT2FN["gelu_pytorch_tanh"](gate) * up).double()
    bound = 4e-7 * exact.abs() + 1e-7
    assert ((ours - exact).abs() <= torch.maximum(bound, (theirs - exact).abs())).all()
    gate16, up16 = x.to(torch.bfloat16).chunk(2, dim=-1)
    torch.testing.assert_close(GeluAndMul()(torch.cat([gate16, up16], dim=-1)),
                               ACT2FN["gelu_pytorch_tanh"](gate16) * up16, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_rms_norm_equals_transformers(dtype):
    """The weight holds 1 + w in float32 whatever the model's dtype: in bfloat16 too the product is taken in float32
    before rounding, with 1 + w exact, as Gemma does."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    reference = Gemma3RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        reference.weight.normal_(0.0, 0.5)
    reference = reference.to(dtype)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # as the loader builds a model
    try:
        ours = GemmaRMSNorm(64, eps=1e-6)
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        ours.weight.copy_(reference.weight.float() + 1.0)
    x = torch.randn(3, 7, 64).to(dtype)
    # bfloat16 runs the same PyTorch operations (bit-equal); float32 the C kernel (float rounding apart).
    tolerance = 0.0 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(ours(x), reference(x), rtol=tolerance, atol=tolerance)
