"""The fused CPU decode step (every decoder layer in one C call) against the module-by-module path on the same
weights, for each model variant (plain Llama, Qwen2's biases, Qwen3's per-head norms, Gemma 3's output norms,
tanh-GELU, per-layer RoPE bases and windows; SmolLM3's layers without RoPE) and weight storage (float32,
int8 blocks), and over float16, bfloat16 and fp8 KV caches. The module path itself is checked against transformers
in tests/entrypoints."""
from __future__ import annotations

import pytest

from pagellm import LLM, SamplingParams
from pagellm.kernels.decoder import FusedDecoder
from pagellm.model_executor.models.gemma3 import Gemma3ForCausalLM
from pagellm.model_executor.models.llama import LlamaForCausalLM


def model_of(llm: LLM):
    return llm.llm_engine.engine_core.executor.collective_rpc("__getattribute__", "model_runner")[0].model


def run(model_dir, quantization: str, fused: bool, prompts, monkeypatch, kv_cache_dtype: str = "auto"
        ) -> tuple[list, LLM]:
    for model_class in (LlamaForCausalLM, Gemma3ForCausalLM):
        monkeypatch.setattr(model_class, "use_fused_decoder", fused)
    llm = LLM(model=str(model_dir), max_model_len=128, kv_cache_memory_bytes=4 << 20, quantization=quantization,
              kv_cache_dtype=kv_cache_dtype)
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=3, ignore_eos=True)
    return llm.generate(prompts, params, use_tqdm=False), llm


@pytest.mark.parametrize("kind,quantization,kv_cache_dtype", [
    *((kind, quantization, "auto") for kind in ("llama", "qwen2", "qwen3") for quantization in ("none", "int8")),
    ("llama", "none", "float16"), ("qwen3", "int8", "bfloat16"),  # the fused step writes and reads a narrow cache
    ("qwen2", "int8", "fp8"),
    ("gemma3", "none", "auto"), ("gemma3", "int8", "float16"),
    ("smollm3", "none", "auto"),  # NoPE layers: no rotation
])
def test_fused_decode_matches_module_path(kind, quantization, kv_cache_dtype, tiny_model_factory, make_token_prompts,
                                          monkeypatch):
    model_dir = tiny_model_factory(kind)
    prompts = make_token_prompts([3, 17, 40], seed=11)
    fused, fused_llm = run(model_dir, quantization, True, prompts, monkeypatch, kv_cache_dtype)
    assert isinstance(model_of(fused_llm).fused_step.decoder, FusedDecoder), "the fused path must have run"
    modules, module_llm = run(model_dir, quantization, False, prompts, monkeypatch, kv_cache_dtype)
    assert model_of(module_llm).fused_step.decoder is None
    for a, b in zip(fused, modules):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for entry_a, entry_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for token, logprob in entry_b.items():
                assert entry_a[token].logprob == pytest.approx(logprob.logprob, abs=1e-4)
