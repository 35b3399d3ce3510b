"""What each GGUF `general.architecture` converts to: the Hugging Face architecture and the config entries beyond the
common ones, the tensor names, and what llama.cpp's converter did to the tensors that the conversion undoes (Q/K rows
permuted for Llama, 1 added to Gemma's norm weights).

Adding a GGUF family is one entry in GGUF_ARCHITECTURES (and, where llama.cpp keeps settings in code rather than in
the file, a function that writes them into the config, as `gemma3_config` does).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# Reads `{architecture}.{name}` from the file's metadata, with a default.
MetadataKey = Callable[..., Any]

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


def no_extra_config(key: MetadataKey, config: dict[str, Any]) -> dict[str, Any]:
    return {}


def no_sliding_window(key: MetadataKey, config: dict[str, Any]) -> dict[str, Any]:
    # Qwen2 checkpoints carry a sliding-window size that only some layers of some sizes use; GGUF files have none.
    return {"use_sliding_window": False}


def gemma3_config(key: MetadataKey, config: dict[str, Any]) -> dict[str, Any]:
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


@dataclass(frozen=True)
class GGUFArchitecture:
    hf_architecture: str  # the Hugging Face `architectures` entry (see models/registry.py)
    model_type: str
    # llama.cpp's converter permutes Q/K rows for its interleaved rotary layout where the model uses rotate-half
    # rotary in the interleaved ("normal") rope mode: Llama. NeoX-mode models (Qwen, Gemma) are stored as they are.
    rotary_permuted: bool
    extra_config: Callable[[MetadataKey, dict[str, Any]], dict[str, Any]] = no_extra_config
    # Layer tensors named differently from LAYER_TENSORS (GGUF stem -> Hugging Face module path).
    tensor_names: dict[str, str] = field(default_factory=dict)
    # llama.cpp stores every norm weight plus this (Gemma's norms scale by 1 + w; llama.cpp's by w).
    norm_offset: float = 0.0

    def hf_layer_tensor(self, stem: str) -> str | None:
        return self.tensor_names.get(stem) or LAYER_TENSORS.get(stem)


# general.architecture -> what it converts to. Mistral files say "llama".
GGUF_ARCHITECTURES = {
    "llama": GGUFArchitecture("LlamaForCausalLM", "llama", rotary_permuted=True),
    "qwen2": GGUFArchitecture("Qwen2ForCausalLM", "qwen2", rotary_permuted=False, extra_config=no_sliding_window),
    "qwen3": GGUFArchitecture("Qwen3ForCausalLM", "qwen3", rotary_permuted=False, extra_config=no_sliding_window),
    "gemma3": GGUFArchitecture(
        "Gemma3ForCausalLM", "gemma3_text", rotary_permuted=False, extra_config=gemma3_config, norm_offset=1.0,
        tensor_names={"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                      "post_ffw_norm": "post_feedforward_layernorm"}),
}
