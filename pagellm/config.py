"""Engine configuration: one dataclass per concern, validated once when built. Each setting's default is written
here, once (`EngineArgs` and the CLI read it), and configs are built with keywords only."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
}


# Halving the cache's bytes (float16, bfloat16) doubles the tokens it holds and halves what decode attention reads;
# K and V are then rounded, so outputs are no longer exactly those of the model's dtype. The 8-bit floats (vLLM's
# names; "fp8" is e4m3) quarter a float32 cache, unscaled and saturating at the type's largest finite value.
KV_CACHE_DTYPES = {"auto": None, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                   "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


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


@dataclass(kw_only=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None  # None: derived from free memory
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    swap_space_bytes: int = 4 << 30  # the host-memory block tier (swap-out and second-level prefix cache)
    cache_dtype: str = "auto"  # the KV cache's element type, a KV_CACHE_DTYPES key ("auto": the model's dtype)

    def kv_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return KV_CACHE_DTYPES[self.cache_dtype] or model_dtype

    def metrics_info(self, model_dtype: torch.dtype) -> dict[str, str]:
        """Every setting as a string, and the element type the cache holds (`kv_dtype`, what "auto" resolves to):
        the labels of /metrics' `cache_config_info`, as vLLM exports its cache config."""
        info = {setting.name: str(getattr(self, setting.name)) for setting in fields(self)}
        info["kv_dtype"] = str(self.kv_dtype(model_dtype)).removeprefix("torch.")
        return info

    def __post_init__(self) -> None:
        if self.cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.cache_dtype!r}; "
                             f"fix --kv-cache-dtype.")
        if self.swap_space_bytes < 0:
            raise ValueError(f"swap_space must not be negative, got {self.swap_space_bytes} bytes; fix --swap-space.")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}.")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}.")


SCHEDULING_POLICIES = ("fcfs", "priority", "short-first")
PREEMPTION_MODES = ("recompute", "swap")


SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model")


@dataclass
class SpeculativeConfig:
    """vLLM's speculative decoding settings (--speculative-config as JSON). `ngram`: prompt lookup, drafts copied
    from the prompt and output so far after the longest suffix n-gram (prompt_lookup_min..max tokens) seen before
    (see spec_decode/). `draft_model`: a smaller model (`model`, with the target's vocabulary) drafts greedily in
    the worker (worker/draft_proposer.py)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4  # k: the most draft tokens a request verifies a step (spec_decode/adaptive.py)
    # suffix (spec_decode/suffix_proposer.py): the longest suffix of the sequence matched; the most tokens a draft
    # has per matched token; the least estimated probability (frequency) of a drafted token given the match; the
    # finished requests whose outputs are searched too (0: none).
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    suffix_decoding_max_cached_requests: int = 10000
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    # draft_model: the draft's checkpoint directory, .gguf file or hub id, and its tensor-parallel size (1 only).
    model: str | None = None
    draft_tensor_parallel_size: int | None = None
    # Resolved by EngineArgs from `model` (not a user field): the draft's ModelConfig.
    draft_model_config: ModelConfig | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(SPECULATIVE_METHODS)}, got "
                             f"{self.method!r}; fix --speculative-config.")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative_config.model names the draft model of method 'draft_model', which needs "
                             f"it (got method {self.method!r}, model {self.model!r}); fix --speculative-config.")
        if self.draft_tensor_parallel_size not in (None, 1):
            raise ValueError(f"speculative_config.draft_tensor_parallel_size must be 1 (the draft runs on one rank), "
                             f"got {self.draft_tensor_parallel_size}; fix --speculative-config.")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"speculative_config.num_speculative_tokens must be at least 1, got "
                             f"{self.num_speculative_tokens}; fix --speculative-config.")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}; fix --speculative-config.")
        if self.suffix_decoding_max_tree_depth < 1:
            raise ValueError(f"speculative_config.suffix_decoding_max_tree_depth must be at least 1, got "
                             f"{self.suffix_decoding_max_tree_depth}; fix --speculative-config.")
        if not self.suffix_decoding_max_spec_factor > 0:
            raise ValueError(f"speculative_config.suffix_decoding_max_spec_factor must be positive, got "
                             f"{self.suffix_decoding_max_spec_factor}; fix --speculative-config.")
        if not 0.0 <= self.suffix_decoding_min_token_prob <= 1.0:
            raise ValueError(f"speculative_config.suffix_decoding_min_token_prob must be in [0, 1], got "
                             f"{self.suffix_decoding_min_token_prob}; fix --speculative-config.")
        if self.suffix_decoding_max_cached_requests < 0:
            raise ValueError(f"speculative_config.suffix_decoding_max_cached_requests must not be negative, got "
                             f"{self.suffix_decoding_max_cached_requests}; fix --speculative-config.")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SpeculativeConfig:
        known = [f.name for f in fields(cls) if f.name != "draft_model_config"]
        unknown = set(values) - set(known)
        if unknown:
            raise ValueError(f"speculative_config has unknown fields {sorted(unknown)}; known: {', '.join(known)}.")
        return cls(**values)


@dataclass(kw_only=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"
    preemption_mode: str = "recompute"
    # short-first: a request that has waited this long goes ahead of every shorter one (the starvation bound).
    short_first_max_wait: float = 10.0
    # Schedule batch N+1 while batch N runs (see core/sched/async_scheduling.py).
    async_scheduling: bool = False
    # Speculative decoding: the scheduler drafts and verifies tokens (see spec_decode/); None: off.
    speculative_config: SpeculativeConfig | None = None
    # A time per output token to hold: the scheduler caps each step's rows (up to max_num_seqs) and prompt tokens
    # by an online model of the step's time (core/sched/step_limits.py); None: the static caps only.
    target_tpot_ms: float | None = None
    # Priority policy: requests of this priority or lower are background work (the lines of /v1/batches jobs run
    # at it): they yield each step to others and take a bounded share of it (core/sched/step_limits.py).
    background_priority: int = 1 << 30

    def __post_init__(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got "
                             f"{self.scheduling_policy!r}; fix --scheduling-policy.")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, got "
                             f"{self.preemption_mode!r}; fix --preemption-mode.")
        if self.short_first_max_wait < 0:
            raise ValueError(f"short_first_max_wait must not be negative, got {self.short_first_max_wait}; fix "
                             f"--short-first-max-wait.")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}.")
        if self.target_tpot_ms is not None and not self.target_tpot_ms > 0:
            raise ValueError(f"target_tpot_ms must be positive, got {self.target_tpot_ms}; fix --target-tpot-ms.")

    def check_fits(self, max_model_len: int) -> None:
        """Without chunked prefill a prompt runs in one step, so the token budget must hold the longest one."""
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"With chunked prefill disabled, max_num_batched_tokens ({self.max_num_batched_tokens}) must be at "
                f"least max_model_len ({max_model_len}), or a long prompt could never be scheduled. Raise "
                f"max_num_batched_tokens (--max-num-batched-tokens), lower max_model_len (--max-model-len), or "
                f"enable chunked prefill.")


DISTRIBUTED_EXECUTOR_BACKENDS = ("uni", "mp", "ray")


@dataclass(kw_only=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # None: "uni" (this process) for one rank, "mp" (one process per rank on this machine) for more.
    distributed_executor_backend: str | None = None
    # Engine replicas behind one server, each with its own scheduler, KV cache and tp x pp ranks; this
    # replica's index among them.
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    # Keep a batch per pipeline stage in flight, so stages work at once (see EngineArgs.pipeline_overlap).
    pipeline_overlap: bool = False
    # CPU cores per rank (worker/cpu_affinity.py): None leaves scheduling to the OS, "auto" splits this process's
    # cores among the ranks that run at once, "0-3|4-7" names them.
    cpu_affinity: str | None = None

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}; fix "
                                 f"--{name.replace('_', '-')}.")
        if self.distributed_executor_backend is None:
            self.distributed_executor_backend = "uni" if self.world_size == 1 else "mp"
        if self.distributed_executor_backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of {', '.join(DISTRIBUTED_EXECUTOR_BACKENDS)}, "
                             f"got {self.distributed_executor_backend!r}; fix --distributed-executor-backend.")
        if self.distributed_executor_backend == "uni" and self.world_size > 1:
            raise ValueError(f"The 'uni' executor runs one rank in this process, but tensor x pipeline parallel "
                             f"size is {self.world_size}; use --distributed-executor-backend mp or ray.")

    @property
    def concurrent_ranks(self) -> int:
        """Ranks computing at the same time on this machine, every replica's: each gets its own cores."""
        return self.tensor_parallel_size * self.concurrent_stages * self.data_parallel_size

    def cpu_slot(self, rank: int) -> int:
        """Rank `rank` (of this replica)'s place among the concurrent ranks: stages that take turns share one."""
        stage, tp_rank = divmod(rank, self.tensor_parallel_size)
        return ((self.data_parallel_rank * self.concurrent_stages + stage % self.concurrent_stages)
                * self.tensor_parallel_size + tp_rank)

    @property
    def concurrent_stages(self) -> int:
        """Pipeline stages that compute at the same time: all of them with pipeline_overlap, else one."""
        return self.pipeline_parallel_size if self.pipeline_overlap else 1

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def output_rank(self) -> int:
        """The rank whose step result the engine uses: the last pipeline stage's first tensor-parallel rank (the
        only stage that computes logits; ranks are laid out pp_rank * tp + tp_rank)."""
        return (self.pipeline_parallel_size - 1) * self.tensor_parallel_size

    def pp_rank(self, rank: int) -> int:
        """The pipeline stage of global rank `rank`."""
        return rank // self.tensor_parallel_size


@dataclass(kw_only=True)
class StructuredOutputsConfig:
    # JSON schemas' objects admit only the properties they name unless the schema says otherwise (vLLM's
    # xgrammar default; a request's own `disable_additional_properties` overrides it). See structured_output/.
    disable_additional_properties: bool = True
    # vLLM's --reasoning-parser: how outputs split into reasoning and content (see pagellm/reasoning/), and the tags
    # a request's thinking_token_budget counts between. None: no reasoning output.
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        from pagellm.reasoning import get_reasoning_parser

        if self.reasoning_parser is not None:
            get_reasoning_parser(self.reasoning_parser)


@dataclass(kw_only=True)
class DeviceConfig:
    device: torch.device


@dataclass(kw_only=True)
class LoRAConfig:
    """Multi-LoRA (vLLM's flags): PEFT adapters applied per request over the unchanged base weights."""
    enable_lora: bool = False
    lora_modules: tuple[str, ...] = ()  # "name=path" adapters the server serves from the start
    max_loras: int = 1  # adapters the server serves at once, and the worker keeps loaded (LRU)
    max_lora_rank: int = 16

    def __post_init__(self) -> None:
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError(f"--max-loras and --max-lora-rank must be at least 1, got {self.max_loras} and "
                             f"{self.max_lora_rank}.")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora.")


@dataclass(kw_only=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    device_config: DeviceConfig
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    lora_config: LoRAConfig = field(default_factory=LoRAConfig)

    def __post_init__(self) -> None:
        self.scheduler_config.check_fits(self.model_config.max_model_len)
