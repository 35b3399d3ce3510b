"""Which Hugging Face `architectures` entry maps to which model class."""
from __future__ import annotations

from torch import nn

from pagellm.model_executor.models.llama import LlamaForCausalLM
from pagellm.model_executor.models.qwen2 import Qwen2ForCausalLM
from pagellm.model_executor.models.qwen3 import Qwen3ForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_architecture(hf_config) -> str:
    for arch in getattr(hf_config, "architectures", None) or []:
        if arch in _MODELS:
            return arch
    found = getattr(hf_config, "architectures", None) or [getattr(hf_config, "model_type", "unknown")]
    raise ValueError(f"Model architecture {', '.join(found)} is not supported. "
                     f"Supported architectures: {', '.join(supported_architectures())}.")


def get_model_class(architecture: str) -> type[nn.Module]:
    return _MODELS[architecture]
