"""Which Hugging Face `architectures` entry maps to which model class. A model's module is imported only when that
model is built, so adding a family is one file plus one line here."""
from __future__ import annotations

import importlib

from torch import nn

# architecture -> (module under pagellm.model_executor.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "SmolLM3ForCausalLM": ("smollm3", "SmolLM3ForCausalLM"),
    "BertModel": ("bert", "BertModel"),
}
# Encoder-only architectures: bidirectional attention over whole prompts, no KV cache, embeddings only (the pooling
# runner). The engine runs their prompts unchunked and uncached, and pools them by CLS unless the checkpoint's
# sentence-transformers config says otherwise (vLLM's default for BERT).
_ENCODER_ONLY = frozenset({"BertModel"})


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_architecture(hf_config) -> str:
    for arch in getattr(hf_config, "architectures", None) or []:
        if arch in _MODELS:
            return arch
    found = getattr(hf_config, "architectures", None) or [getattr(hf_config, "model_type", "unknown")]
    raise ValueError(f"Model architecture {', '.join(found)} is not supported. "
                     f"Supported architectures: {', '.join(supported_architectures())}.")


def is_encoder_only(architecture: str) -> bool:
    return architecture in _ENCODER_ONLY


def get_model_class(architecture: str) -> type[nn.Module]:
    module_name, class_name = _MODELS[architecture]
    return getattr(importlib.import_module(f"pagellm.model_executor.models.{module_name}"), class_name)
