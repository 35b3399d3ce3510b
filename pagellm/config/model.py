"""What model runs, and where: `ModelConfig` (the checkpoint, its dtype, quantization, runner), `PoolerConfig`
(how embeddings are pooled), `DeviceConfig`, and the resolution of the device and dtype names users give."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
}


def resolve_device(device: str | torch.device) -> torch.device:
    device_name = str(device)
    if device_name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device_name!r}.")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but no CUDA device is available; use device='cpu'.")
    return device


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """'auto' is float32 on CPU (bf16 matmuls are slow on most CPUs) and bfloat16 on CUDA, float16 on GPUs older
    than compute capability 8.0 (Turing, Volta), which have no bfloat16 arithmetic."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; use float32, bfloat16 or float16.")
        return dtype
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        return torch.bfloat16 if torch.cuda.get_device_capability(device) >= (8, 0) else torch.float16
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be 'auto', 'float32', 'bfloat16' or 'float16', got {dtype!r}.")
    return _DTYPES[dtype]


@dataclass(kw_only=True)
class DeviceConfig:
    device: torch.device


# How a model runs (vLLM's --runner): "generate" serves completions (and also embeds and scores, prefill-only, in
# the same batches); "pooling" serves embeddings and scores only (/score then compares embeddings by cosine).
# "auto" is "pooling" for an encoder-only model (BERT) and "generate" for the causal LMs: an embedding checkpoint
# such as Qwen3-Embedding (a plain Qwen3ForCausalLM) needs --runner pooling.
RUNNERS = ("auto", "generate", "pooling")
POOLING_TYPES = ("LAST", "MEAN", "CLS")  # vLLM's PoolerConfig.pooling_type names


@dataclass(kw_only=True)
class PoolerConfig:
    """How embeddings are pooled from the final-norm hidden states of the prompt (vLLM's PoolerConfig): the last
    token's (causal LMs' default, and Qwen3-Embedding's), the mean over the prompt, or the first token's (CLS);
    L2-normalised unless `normalize` is False (a request's own `normalize` overrides it)."""

    pooling_type: str = "LAST"
    normalize: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.pooling_type, str) or self.pooling_type.upper() not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}; "
                             f"fix --pooler-config.")
        self.pooling_type = self.pooling_type.upper()
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true or false, got {self.normalize!r}; fix --pooler-config.")


@dataclass(kw_only=True)
class ModelConfig:
    model: str  # local Hugging Face-style checkpoint directory
    tokenizer: str
    hf_config: Any  # transformers.PretrainedConfig
    architecture: str
    dtype: torch.dtype
    max_model_len: int
    max_logprobs: int = 20  # the most logprobs / prompt_logprobs one request may ask for
    seed: int = 0
    served_model_name: str | None = None
    quantization: str = "none"  # how weights are stored: see layers/quantization.py
    quantize_activations: bool = False  # int8 activations for packed weights (linear_int8.inc)
    gguf_file: str | None = None  # the GGUF file the checkpoint directory was converted from
    enforce_eager: bool = False  # CUDA: no decode graphs
    runner: str = "generate"  # "generate" or "pooling" (RUNNERS; "auto" is resolved by EngineArgs)
    pooler_config: PoolerConfig = field(default_factory=PoolerConfig)

    @property
    def num_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        return getattr(self.hf_config, "num_key_value_heads", None) or self.hf_config.num_attention_heads

    def get_num_kv_heads(self, tensor_parallel_size: int = 1) -> int:
        """KV heads one tensor-parallel rank holds (and caches), as QKVParallelLinear splits them: an equal share,
        or one replicated head when there are fewer KV heads than ranks."""
        return max(1, self.num_kv_heads // tensor_parallel_size)

    @property
    def head_dim(self) -> int:
        return getattr(self.hf_config, "head_dim", None) or (
            self.hf_config.hidden_size // self.hf_config.num_attention_heads)

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size
