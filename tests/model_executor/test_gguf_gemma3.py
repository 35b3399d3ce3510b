"""Gemma 3 270M's real Q4_K_M file converts to exactly what transformers loads from it: the config (layer pattern,
both RoPE bases, sliding window, query scale) and every tensor, with llama.cpp's +1 on the norm weights undone."""
from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from pagellm.model_executor.model_loader.gguf_loader import convert_gguf_to_hf_dir

CONFIG_FIELDS = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "rms_norm_eps", "sliding_window", "query_pre_attn_scalar",
                 "layer_types", "rope_parameters", "tie_word_embeddings", "hidden_activation",
                 "final_logit_softcapping", "bos_token_id", "eos_token_id", "pad_token_id"]


def test_conversion_equals_transformers(gemma3_gguf, gemma3_reference):
    from transformers import AutoConfig

    out_dir = convert_gguf_to_hf_dir(gemma3_gguf)
    assert json.loads((out_dir / "config.json").read_text())["architectures"] == ["Gemma3ForCausalLM"]
    config = AutoConfig.from_pretrained(str(out_dir))
    for field in CONFIG_FIELDS:
        assert getattr(config, field) == getattr(gemma3_reference.config, field), field
    assert config.layer_types.count("full_attention") == 3  # layers 6, 12 and 18 of 18

    ours = load_file(str(out_dir / "model.safetensors"))
    reference = gemma3_reference.state_dict()
    assert set(ours) == set(reference) - {"lm_head.weight"}  # tied to the embedding
    for name, tensor in ours.items():
        assert torch.equal(tensor.float(), reference[name]), name
    # The norms are stored as 1 + w; what the checkpoint holds is w, centred near 0 rather than near 1.
    assert ours["model.norm.weight"].mean().abs() < ours["model.norm.weight"].add(1).mean().abs()
