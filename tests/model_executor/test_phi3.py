"""Phi-3 / Phi-4-mini: the checkpoint's fused matrices load whole, LongRoPE's tables equal transformers' short-factor
ones within the original context and a longer max_model_len is refused, and the one-call CPU decode step applies
only where whole heads rotate. Whole-engine comparisons: tests/entrypoints/test_llm_phi3_qwen3_moe.py."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from pagellm import LLM
from pagellm.kernels.decoder import FusedDecoder
from pagellm.model_executor.layers.rotary_embedding import RotaryEmbedding, longrope_limit
from pagellm.model_executor.models.phi3 import Phi3ForCausalLM


def model_of(llm: LLM):
    return llm.llm_engine.engine_core.executor.collective_rpc("__getattribute__", "model_runner")[0].model


def test_longrope_tables_equal_transformers_within_the_original_context(tiny_model_factory):
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    config = AutoConfig.from_pretrained(tiny_model_factory("phi3-longrope"))
    assert longrope_limit(config) == 256
    head_dim = config.hidden_size // config.num_attention_heads
    rope = RotaryEmbedding(config, head_dim, 256)
    positions = torch.arange(256)
    cos, sin = Phi3RotaryEmbedding(config)(torch.zeros(1, 256, head_dim), positions[None])
    assert cos[0, 1].abs().max() > 1.0, "the attention factor scales the tables"
    torch.testing.assert_close(rope.cos_cache, cos[0], rtol=0, atol=1e-6)
    half = head_dim // 2  # pagellm's sine carries rotate-half's sign in its first half
    torch.testing.assert_close(rope.sin_cache[:, half:], sin[0, :, half:], rtol=0, atol=1e-6)
    torch.testing.assert_close(rope.sin_cache[:, :half], -sin[0, :, :half], rtol=0, atol=1e-6)


def test_longrope_context_beyond_the_original_is_refused(tiny_model_factory):
    with pytest.raises(ValueError, match=r"original_max_position_embeddings \(256\).*--max-model-len 256"):
        LLM(model=str(tiny_model_factory("phi3-longrope")), max_model_len=257, kv_cache_memory_bytes=4 << 20)
    with pytest.raises(ValueError, match=r"original_max_position_embeddings \(256\).*--max-model-len 256"):
        Phi3ForCausalLM(AutoConfig.from_pretrained(tiny_model_factory("phi3-longrope")), max_position=257)


def test_longrope_default_context_is_the_original(tiny_model_factory):
    llm = LLM(model=str(tiny_model_factory("phi3-longrope")), kv_cache_memory_bytes=4 << 20)
    assert llm.llm_engine.config.model_config.max_model_len == 256  # max_position_embeddings is 1024


def test_no_bound_without_longrope(tiny_model_factory):
    assert longrope_limit(AutoConfig.from_pretrained(tiny_model_factory("phi3"))) is None


@pytest.mark.parametrize("kind, fused", [("phi3-longrope", True), ("phi3", False)])
def test_fused_matrices_load_whole_and_the_fused_step_needs_whole_head_rotary(tiny_model_factory, kind, fused):
    model_dir = tiny_model_factory(kind)
    llm = LLM(model=str(model_dir), max_model_len=128, kv_cache_memory_bytes=4 << 20)
    model = model_of(llm)
    assert isinstance(model, Phi3ForCausalLM)
    checkpoint = load_file(model_dir / "model.safetensors")
    for index, layer in enumerate(model.layers):
        for name, module in (("self_attn.qkv_proj", layer.self_attn.qkv_proj), ("mlp.gate_up_proj",
                                                                                 layer.mlp.gate_up_proj)):
            torch.testing.assert_close(module.weight, checkpoint[f"model.layers.{index}.{name}.weight"],
                                       rtol=0, atol=0)
    assert isinstance(model.fused_decoder(), FusedDecoder) is fused
