"""Shared fixtures: the default SmolLM2 model converted once per session, and tiny random-weight checkpoints
(Llama, Qwen2, Qwen3) built from Hugging Face configs, with SmolLM2's real tokenizer."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")

TINY_CONFIGS = {
    "llama": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                  rope_theta=10000.0),
    "llama3": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=128,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True,
                   rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 64}),
    "qwen2": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  tie_word_embeddings=True),
}


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The default model as a Hugging Face-style directory (converted from its GGUF, cached on disk)."""
    from pagellm.model_executor.model_loader.resolve import resolve_model_dir

    return resolve_model_dir(None)


def build_tiny_model(kind: str, path: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    """Save a random-weight model of `kind` (see TINY_CONFIGS) with SmolLM2's tokenizer into `path`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(TINY_CONFIGS[kind], vocab_size=49152, max_position_embeddings=1024, rms_norm_eps=1e-6,
                  bos_token_id=1, eos_token_id=2, pad_token_id=2)
    fields.update(overrides)
    model_type = fields.pop("model_type")
    config = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Larger-than-default init so random logits have clear winners (fewer float near-ties in greedy tests).
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.08)
            elif "bias" in name:
                param.normal_(0.0, 0.05)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, path / name)
    return path


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory, smollm2_dir):
    cache: dict[str, Path] = {}

    def make(kind: str = "llama", **overrides) -> Path:
        key = kind + repr(sorted(overrides.items()))
        if key not in cache:
            cache[key] = build_tiny_model(kind, tmp_path_factory.mktemp(f"tiny-{kind}"), smollm2_dir, **overrides)
        return cache[key]

    return make
