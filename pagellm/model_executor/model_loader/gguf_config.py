"""A GGUF file's metadata as a Hugging Face config: sizes, special token ids, the architecture's extra keys, and rope
scaling (linear, YaRN, or llama3's recovered from llama.cpp's per-frequency `rope_freqs` divisors)."""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import gguf
import numpy as np
from gguf import quants

from pagellm.model_executor.model_loader.gguf_architectures import GGUF_ARCHITECTURES, ROPE_FREQS


def gguf_metadata(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    return default if field is None else field.contents()


def build_config(reader: gguf.GGUFReader, arch: str, tensors: dict[str, Any]) -> dict[str, Any]:
    def key(name: str, default: Any = None) -> Any:
        return gguf_metadata(reader, f"{arch}.{name}", default)

    if "token_embd.weight" not in tensors:
        raise ValueError("GGUF file has no token_embd.weight tensor")
    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    head_dim = int(key("attention.key_length") or key("rope.dimension_count") or hidden // heads)
    vocab_size = int(tensors["token_embd.weight"].shape[-1])  # GGUF shape is [hidden, vocab]
    ffn = key("feed_forward_length")
    intermediate = int(ffn) if ffn is not None else int(tensors["blk.0.ffn_gate.weight"].shape[-1])
    architecture = GGUF_ARCHITECTURES[arch]
    config: dict[str, Any] = {
        "architectures": [architecture.hf_architecture],
        "model_type": architecture.model_type,
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(key("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "torch_dtype": "float32",
    }
    for hf_key, gguf_key in (
        ("bos_token_id", "bos_token_id"),
        ("eos_token_id", "eos_token_id"),
        ("pad_token_id", "padding_token_id"),
    ):
        value = gguf_metadata(reader, f"tokenizer.ggml.{gguf_key}")
        if value is not None:
            config[hf_key] = int(value)
    rope_scaling = _rope_scaling(key, tensors, config)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    config.update(architecture.extra_config(key, config, tensors))
    return config


def _rope_scaling(
    key: Callable[..., Any], tensors: dict[str, Any], config: dict[str, Any]
) -> dict[str, Any] | None:
    kind = key("rope.scaling.type")
    factor = key("rope.scaling.factor") or key("rope.scale_linear")
    orig_ctx = key("rope.scaling.original_context_length")
    if kind == "linear" or (kind is None and factor and ROPE_FREQS not in tensors):
        return {"rope_type": "linear", "factor": float(factor)} if factor and factor != 1.0 else None
    if kind == "yarn":
        scaling: dict[str, Any] = {"rope_type": "yarn", "factor": float(factor)}
        if orig_ctx:
            scaling["original_max_position_embeddings"] = int(orig_ctx)
        for hf_name, gguf_name in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
            if (value := key(f"rope.scaling.{gguf_name}")) is not None:
                scaling[hf_name] = float(value)
        return scaling
    if kind not in (None, "none"):
        raise ValueError(f"Unsupported GGUF rope scaling type {kind!r}")
    if ROPE_FREQS not in tensors:
        return None
    rope_freqs = tensors[ROPE_FREQS]
    divisors = np.asarray(quants.dequantize(rope_freqs.data, rope_freqs.tensor_type), dtype=np.float64).ravel()
    return _llama3_scaling(divisors, config["rope_theta"], config["head_dim"], int(orig_ctx or 8192))


def _llama3_scaling(divisors: np.ndarray, theta: float, head_dim: int, orig_ctx: int) -> dict[str, Any]:
    """Recover HF llama3 rope parameters from llama.cpp's per-frequency divisors (rope_freqs)."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    factor = float(divisors.max())
    # llama.cpp's own defaults; only used as-is when no frequency falls inside the smoothing band.
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": orig_ctx,
    }
    medium = (divisors > 1 + 1e-6) & (divisors < factor * (1 - 1e-6))
    if medium.sum() >= 2 and factor > 1:
        # In the smoothing band 1/divisor = (1-s)/factor + s with s linear in inv_freq; fit that line.
        smooth = (1 / divisors[medium] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(inv_freq[medium], smooth, 1)
        span = orig_ctx / (2 * math.pi * slope)
        scaling["low_freq_factor"] = float(-intercept * span)
        scaling["high_freq_factor"] = float(-intercept * span + span)
    if not np.allclose(_llama3_divisors(inv_freq, scaling), divisors, rtol=1e-4):
        raise ValueError("GGUF rope_freqs tensor does not match llama3-style rope scaling")
    return scaling


def _llama3_divisors(inv_freq: np.ndarray, s: dict[str, Any]) -> np.ndarray:
    ctx, factor = s["original_max_position_embeddings"], s["factor"]
    low, high = s["low_freq_factor"], s["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (ctx / wavelen - low) / (high - low)
    scale = np.where(wavelen < ctx / high, 1.0, (1 - smooth) / factor + smooth)
    scale = np.where(wavelen > ctx / low, 1 / factor, scale)
    return 1 / scale
