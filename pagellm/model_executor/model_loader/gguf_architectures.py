"""What each GGUF `general.architecture` converts to: the Hugging Face architecture and the config entries beyond the
common ones, the tensor names, and what llama.cpp's converter did to the tensors that the conversion undoes (Q/K rows
permuted for Llama, 1 added to Gemma's norm weights, experts' matrices stacked into one tensor for MoE models).

Adding a GGUF family is one entry in GGUF_ARCHITECTURES (and, where llama.cpp keeps settings in code or in tensors
rather than in the metadata, a function that writes them into the config, as `gemma3_config` does).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from gguf import quants

# Reads `{architecture}.{name}` from the file's metadata, with a default.
MetadataKey = Callable[..., Any]
# The file's tensors by GGUF name (gguf.ReaderTensor: name, tensor_type, shape, data).
Tensors = Mapping[str, Any]

# Tensors that hold settings, which the conversion reads into the config, not weights: llama3-style rope's
# per-frequency divisors, and LongRoPE's long and short factors (Phi-3).
ROPE_FREQS = "rope_freqs.weight"
LONGROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")
CONFIG_TENSORS = (ROPE_FREQS, *LONGROPE_FACTORS)
# The placeholder in a module path whose GGUF tensor stacks every expert's matrix ([experts, rows, columns]).
EXPERT = "{expert}"

GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3's and Gemma 3's per-head Q/K RMSNorm
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def no_extra_config(key: MetadataKey, config: dict[str, Any], tensors: Tensors) -> dict[str, Any]:
    return {}


def no_sliding_window(key: MetadataKey, config: dict[str, Any], tensors: Tensors) -> dict[str, Any]:
    # Qwen2 checkpoints carry a sliding-window size that only some layers of some sizes use; GGUF files have none.
    return {"use_sliding_window": False}


def gemma3_config(key: MetadataKey, config: dict[str, Any], tensors: Tensors) -> dict[str, Any]:
    """llama.cpp keeps Gemma 3's layer pattern, local RoPE base and query scale in code, not in the file: every sixth
    layer attends globally, the others within `attention.sliding_window` tokens and rotate with base 10,000; the
    global layers take the file's base and scaling. Queries are scaled by head_dim^-1/2 (the 27B model, 62 layers,
    by (hidden / heads)^-1/2), as llama.cpp does."""
    layers = config["num_hidden_layers"]
    full = {"rope_type": "default", "rope_theta": config.pop("rope_theta")}
    full.update(config.pop("rope_scaling", {}))
    scalar = config["hidden_size"] // config["num_attention_heads"] if layers == 62 else config["head_dim"]
    return {
        "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)],
        "sliding_window": int(key("attention.sliding_window")),
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                            "full_attention": full},
        "query_pre_attn_scalar": scalar,
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
    }


def phi3_config(key: MetadataKey, config: dict[str, Any], tensors: Tensors) -> dict[str, Any]:
    """Phi-3 and Phi-4-mini: `rope.dimension_count` is the rotated part of each head (Phi-4-mini's 0.75), not the
    head size, which is hidden / heads. LongRoPE (the 128k models) is two tensors of per-frequency factors, with the
    pretraining context and the attention factor in the metadata. llama.cpp ignores the sliding window the file may
    carry (it disabled Phi-3's SWA), and so does this."""
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    partial = int(key("rope.dimension_count") or head_dim) / head_dim
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": config.pop("rope_theta"),
                            "partial_rotary_factor": partial}
    extra = {"head_dim": head_dim, "partial_rotary_factor": partial, "sliding_window": None, "rope_parameters": rope}
    if (original := key("rope.scaling.original_context_length")) is not None:
        extra["original_max_position_embeddings"] = int(original)
    if LONGROPE_FACTORS[0] in tensors:
        if original is None:
            raise ValueError("GGUF file has LongRoPE factors but no rope.scaling.original_context_length")
        long, short = (_floats(tensors[name]) for name in LONGROPE_FACTORS)
        rope.update(rope_type="longrope", original_max_position_embeddings=int(original), long_factor=long,
                    short_factor=short)
        if (attention_factor := key("rope.scaling.attn_factor")) is not None:
            rope["attention_factor"] = float(attention_factor)
    return extra


def qwen3moe_config(key: MetadataKey, config: dict[str, Any], tensors: Tensors) -> dict[str, Any]:
    """Qwen3-MoE: every layer a mixture (llama.cpp's graph has no dense layers), its top-k router weights always
    renormalized (llama.cpp's qwen3moe graph, whatever the original config's norm_topk_prob said)."""
    experts_ffn = key("expert_feed_forward_length") or tensors["blk.0.ffn_gate_exps.weight"].shape[1]
    return {"num_experts": int(key("expert_count")), "num_experts_per_tok": int(key("expert_used_count")),
            "moe_intermediate_size": int(experts_ffn), "norm_topk_prob": True, "decoder_sparse_step": 1,
            "mlp_only_layers": [], "use_sliding_window": False}


def _floats(tensor: Any) -> list[float]:
    return [float(v) for v in np.asarray(quants.dequantize(tensor.data, tensor.tensor_type)).ravel()]


def smollm3_config(key: MetadataKey, config: dict[str, Any], tensors: Tensors) -> dict[str, Any]:
    """llama.cpp keeps SmolLM3's layers without RoPE in code: every fourth layer (3, 7, ...), as transformers'
    default `no_rope_layer_interval` (its `no_rope_layers[i]` is 1 where layer i *uses* RoPE); no sliding window."""
    return {"no_rope_layer_interval": 4, "use_sliding_window": False,
            "no_rope_layers": [int((i + 1) % 4 != 0) for i in range(config["num_hidden_layers"])]}


@dataclass(frozen=True)
class GGUFArchitecture:
    hf_architecture: str  # the Hugging Face `architectures` entry (see models/registry.py)
    model_type: str
    # llama.cpp's converter permutes Q/K rows for its interleaved rotary layout where the model uses rotate-half
    # rotary in the interleaved ("normal") rope mode: Llama. NeoX-mode models (Qwen, Gemma) are stored as they are.
    rotary_permuted: bool
    extra_config: Callable[[MetadataKey, dict[str, Any], Tensors], dict[str, Any]] = no_extra_config
    # Layer tensors named differently from LAYER_TENSORS (GGUF stem -> Hugging Face module path; a path with EXPERT
    # is one tensor stacking every expert's matrix, which the conversion splits).
    tensor_names: dict[str, str] = field(default_factory=dict)
    # llama.cpp stores every norm weight plus this (Gemma's norms scale by 1 + w; llama.cpp's by w).
    norm_offset: float = 0.0

    def hf_layer_tensor(self, stem: str) -> str | None:
        return self.tensor_names.get(stem) or LAYER_TENSORS.get(stem)


# general.architecture -> what it converts to. Mistral files say "llama".
GGUF_ARCHITECTURES = {
    "llama": GGUFArchitecture("LlamaForCausalLM", "llama", rotary_permuted=True),
    # llama.cpp's converter writes SmolLM3 as Llama (Q/K rows permuted too).
    "smollm3": GGUFArchitecture("SmolLM3ForCausalLM", "smollm3", rotary_permuted=True, extra_config=smollm3_config),
    "qwen2": GGUFArchitecture("Qwen2ForCausalLM", "qwen2", rotary_permuted=False, extra_config=no_sliding_window),
    "qwen3": GGUFArchitecture("Qwen3ForCausalLM", "qwen3", rotary_permuted=False, extra_config=no_sliding_window),
    "gemma3": GGUFArchitecture(
        "Gemma3ForCausalLM", "gemma3_text", rotary_permuted=False, extra_config=gemma3_config, norm_offset=1.0,
        tensor_names={"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                      "post_ffw_norm": "post_feedforward_layernorm"}),
    # The checkpoint's fused projections as they are: ffn_up holds gate|up.
    "phi3": GGUFArchitecture(
        "Phi3ForCausalLM", "phi3", rotary_permuted=False, extra_config=phi3_config,
        tensor_names={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}),
    "qwen3moe": GGUFArchitecture(
        "Qwen3MoeForCausalLM", "qwen3_moe", rotary_permuted=False, extra_config=qwen3moe_config,
        tensor_names={"ffn_gate_inp": "mlp.gate", "ffn_gate_exps": f"mlp.experts.{EXPERT}.gate_proj",
                      "ffn_up_exps": f"mlp.experts.{EXPERT}.up_proj",
                      "ffn_down_exps": f"mlp.experts.{EXPERT}.down_proj"}),
}
