"""EngineArgs: the user-facing knobs, as `LLM(...)` keywords and the CLI flags that set them (vLLM's names), with
their defaults read from the config classes. create_engine_config() turns them into a validated EngineConfig
(config_builder.py)."""
from __future__ import annotations

import argparse
import json
import os
import re
from dataclasses import dataclass, fields

from pagellm.config import (
    DISTRIBUTED_EXECUTOR_BACKENDS,
    KV_CACHE_DTYPES,
    POOLING_TYPES,
    PREEMPTION_MODES,
    RUNNERS,
    SCHEDULING_POLICIES,
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    PoolerConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
)
from pagellm.engine.config_builder import build_engine_config
from pagellm.model_executor.layers.quantization import QUANTIZATION_METHODS
from pagellm.reasoning import REASONING_PARSERS


@dataclass
class EngineArgs:
    """Every engine setting, as `LLM(...)` keywords and CLI flags. Defaults are read from the config classes; None
    means "resolved when the engine is built" (from the model, the device or the GGUF file)."""
    model: str | os.PathLike | None = None
    tokenizer: str | os.PathLike | None = None
    dtype: str = "auto"
    device: str = "auto"
    seed: int = ModelConfig.seed
    max_model_len: int | None = None  # None: the model's limit
    block_size: int = CacheConfig.block_size
    kv_cache_memory_bytes: int | None = CacheConfig.kv_cache_memory_bytes
    gpu_memory_utilization: float = CacheConfig.gpu_memory_utilization
    max_num_seqs: int | str = SchedulerConfig.max_num_seqs  # "auto": up to the default, held by target_tpot_ms
    max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens
    enable_chunked_prefill: bool = SchedulerConfig.enable_chunked_prefill
    served_model_name: str | None = None
    max_logprobs: int = ModelConfig.max_logprobs
    quantization: str | None = None  # None: "gguf" for a GGUF model on the CPU in float32, else "none"
    quantize_activations: bool = ModelConfig.quantize_activations
    enforce_eager: bool = ModelConfig.enforce_eager
    enable_prefix_caching: bool = CacheConfig.enable_prefix_caching
    swap_space: float = CacheConfig.swap_space_bytes / (1 << 30)  # GiB of host memory for the host block tier
    kv_cache_dtype: str = CacheConfig.cache_dtype
    preemption_mode: str = SchedulerConfig.preemption_mode
    scheduling_policy: str = SchedulerConfig.scheduling_policy
    short_first_max_wait: float = SchedulerConfig.short_first_max_wait  # seconds
    target_tpot_ms: float | None = SchedulerConfig.target_tpot_ms
    tensor_parallel_size: int = ParallelConfig.tensor_parallel_size
    pipeline_parallel_size: int = ParallelConfig.pipeline_parallel_size
    distributed_executor_backend: str | None = ParallelConfig.distributed_executor_backend
    data_parallel_size: int = ParallelConfig.data_parallel_size  # engine replicas (pagellm serve)
    # A batch per pipeline stage in flight. None: on for CUDA (each rank its own device), off on the CPU, where
    # the stages share the same cores and memory bandwidth and splitting batches measured slower.
    pipeline_overlap: bool | None = None
    cpu_affinity: str | None = ParallelConfig.cpu_affinity  # "auto" or "0-3|4-7": each rank's cores
    # Schedule and submit batch N+1 while batch N runs (one rank in this process; see core/sched/async_scheduling.py).
    async_scheduling: bool = SchedulerConfig.async_scheduling
    structured_outputs_disable_additional_properties: bool = StructuredOutputsConfig.disable_additional_properties
    reasoning_parser: str | None = StructuredOutputsConfig.reasoning_parser
    runner: str = "auto"  # RUNNERS: "auto" is "generate" (see config/model.py)
    # vLLM's PoolerConfig, as a PoolerConfig or its fields ({"pooling_type": "MEAN", "normalize": False}); None: the
    # model's default (PoolerConfig()). `pooling` sets only its pooling_type (pagellm's shorthand, --pooling).
    pooler_config: PoolerConfig | dict | None = None
    pooling: str | None = None
    enable_lora: bool = LoRAConfig.enable_lora
    lora_modules: list[str] | None = None  # "name=path" (the server's adapters at start)
    max_loras: int = LoRAConfig.max_loras
    max_lora_rank: int = LoRAConfig.max_lora_rank
    # vLLM's speculative_config: a SpeculativeConfig or its fields ({"method": "ngram", ...}); None: off.
    speculative_config: SpeculativeConfig | dict | None = None

    def create_engine_config(self) -> EngineConfig:
        """These settings as a validated EngineConfig, resolved against the model and the device
        (config_builder.py)."""
        return build_engine_config(self)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """vLLM's flag names for every engine argument."""
        parser.add_argument("--model", default=None,
                            help="checkpoint directory, .gguf file or hub id (default: SmolLM2-135M-Instruct)")
        parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
        parser.add_argument("--dtype", default=EngineArgs.dtype, choices=["auto", "float32", "bfloat16", "float16"],
                            help="auto: float32 on CPU, bfloat16 on CUDA (float16 below compute capability 8.0)")
        parser.add_argument("--device", default=EngineArgs.device, choices=["auto", "cpu", "cuda"])
        parser.add_argument("--seed", type=int, default=EngineArgs.seed)
        parser.add_argument("--max-model-len", type=int, default=None,
                            help="context length (prompt + output); default: the model's")
        parser.add_argument("--block-size", type=int, default=EngineArgs.block_size, help="tokens per KV cache block")
        parser.add_argument("--kv-cache-memory", dest="kv_cache_memory_bytes", type=parse_size,
                            default=EngineArgs.kv_cache_memory_bytes,
                            help="KV cache size, e.g. 2GiB or 512MB (default: a share of free RAM on CPU, "
                                 "--gpu-memory-utilization on CUDA)")
        parser.add_argument("--gpu-memory-utilization", type=float, default=EngineArgs.gpu_memory_utilization)
        parser.add_argument("--max-num-seqs", type=_int_or_auto, default=EngineArgs.max_num_seqs,
                            help="most sequences in one step; auto: as many as --target-tpot-ms allows (up to "
                                 f"{SchedulerConfig.max_num_seqs})")
        parser.add_argument("--target-tpot-ms", type=float, default=EngineArgs.target_tpot_ms,
                            help="time per output token to hold (every request's, p99 included): waiting requests "
                                 "start in waves planned with an online model of the step's time (default: no "
                                 "target)")
        parser.add_argument("--max-num-batched-tokens", type=int, default=EngineArgs.max_num_batched_tokens,
                            help="token budget of one step")
        parser.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                            default=EngineArgs.enable_chunked_prefill)
        parser.add_argument("--max-logprobs", type=int, default=EngineArgs.max_logprobs,
                            help="the most logprobs / prompt_logprobs (top tokens per position) a request may ask for")
        parser.add_argument("--quantization", "-q", default=EngineArgs.quantization, choices=QUANTIZATION_METHODS,
                            help="weight storage: gguf (GGUF blocks kept packed, CPU kernels), int8 (float "
                                 "checkpoints quantized to Q8_0 blocks), none (float). Default: gguf for a .gguf "
                                 "model on the CPU, none otherwise")
        parser.add_argument("--quantize-activations", action=argparse.BooleanOptionalAction,
                            default=EngineArgs.quantize_activations,
                            help="round activations to int8 per block before multiplying with packed weights, in "
                                 "K-quant matmuls and matmuls of up to 48 rows of the other types (llama.cpp's "
                                 "arithmetic): faster, no longer exact")
        parser.add_argument("--enforce-eager", action="store_true", default=EngineArgs.enforce_eager,
                            help="CUDA: run decode steps eagerly, without capturing CUDA graphs")
        parser.add_argument("--async-scheduling", action="store_true", default=EngineArgs.async_scheduling,
                            help="schedule and prepare the next batch while the current one runs, so a GPU never "
                                 "waits for the CPU (one rank in this process)")
        parser.add_argument("--structured-outputs-disable-additional-properties",
                            action=argparse.BooleanOptionalAction,
                            default=EngineArgs.structured_outputs_disable_additional_properties,
                            help="JSON schemas' objects admit only the properties they name unless the schema sets "
                                 "additionalProperties (a request's structured_outputs.disable_additional_properties "
                                 "overrides it)")
        parser.add_argument("--reasoning-parser", default=EngineArgs.reasoning_parser, choices=list(REASONING_PARSERS),
                            help="split <think>...</think> from the answer into reasoning_content (qwen3, "
                                 "deepseek_r1); requests may then set thinking_token_budget")
        parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                            default=EngineArgs.enable_prefix_caching,
                            help="reuse the KV blocks of prompt prefixes seen before (--no-enable-prefix-caching "
                                 "turns it off)")
        parser.add_argument("--swap-space", type=float, default=EngineArgs.swap_space,
                            help="GiB of host memory for the host KV block tier (swap preemption and the "
                                 "second-level prefix cache); 0 turns the tier off")
        parser.add_argument("--kv-cache-dtype", default=EngineArgs.kv_cache_dtype, choices=list(KV_CACHE_DTYPES),
                            help="element type of the KV cache (auto: the model's dtype); float16 or bfloat16 "
                                 "halve a float32 model's cache, so it holds twice the tokens and decode attention "
                                 "reads half the bytes, at the cost of rounding K and V; fp8 (e4m3) and fp8_e5m2 "
                                 "quarter it, unscaled, at a larger cost")
        parser.add_argument("--preemption-mode", default=EngineArgs.preemption_mode, choices=PREEMPTION_MODES,
                            help="what a preempted request's K/V becomes: recomputed later, or swapped to the host "
                                 "tier and back (recompute when the host tier is full)")
        parser.add_argument("--scheduling-policy", default=EngineArgs.scheduling_policy, choices=SCHEDULING_POLICIES,
                            help="fcfs: arrival order; priority: the request's priority (lower first), preempting "
                                 "lower-priority work; short-first: fewest remaining tokens first, with ageing")
        parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=EngineArgs.tensor_parallel_size,
                            help="ranks that each hold a slice of every layer (heads, MLP columns, vocabulary)")
        parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=EngineArgs.pipeline_parallel_size,
                            help="ranks that each hold a contiguous range of layers")
        parser.add_argument("--distributed-executor-backend", default=EngineArgs.distributed_executor_backend,
                            choices=DISTRIBUTED_EXECUTOR_BACKENDS,
                            help="uni: this process (one rank); mp: one process per rank on this machine; ray: "
                                 "Ray actors (multi-node). Default: uni for one rank, mp for more")
        parser.add_argument("--pipeline-overlap", action=argparse.BooleanOptionalAction,
                            default=EngineArgs.pipeline_overlap,
                            help="keep a batch per pipeline stage in flight so stages work at once (the mp "
                                 "executor). Default: on for CUDA, off on the CPU, where stages share the cores")
        parser.add_argument("--cpu-affinity", default=EngineArgs.cpu_affinity,
                            help="CPU cores per rank, each OpenMP thread pinned to one: 'auto' splits this "
                                 "process's cores among the ranks that run at once (tensor x concurrent stages x "
                                 "data-parallel replicas), or one core list per rank such as '0-3|4-7'. Default: "
                                 "the OS schedules the threads")
        parser.add_argument("--data-parallel-size", "-dp", type=int, default=EngineArgs.data_parallel_size,
                            help="pagellm serve: engine replicas, each in its own process with its own KV cache "
                                 "and tp x pp ranks; requests are routed by load and prompt prefix")
        parser.add_argument("--short-first-max-wait", type=float, default=EngineArgs.short_first_max_wait,
                            help="short-first: seconds after which a waiting request goes ahead of shorter ones")
        parser.add_argument("--runner", default=EngineArgs.runner, choices=RUNNERS,
                            help="generate: completions, plus embeddings and scores in the same batches; pooling: "
                                 "an embedding model (embeddings, and /score as cosine similarity), no completions. "
                                 "auto: pooling for an encoder-only model (BERT), else generate")
        parser.add_argument("--speculative-config", type=_json_object, default=EngineArgs.speculative_config,
                            help='speculative decoding as JSON, vLLM\'s: {"method": "ngram", '
                                 '"num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}; '
                                 'methods ngram, suffix, draft_model (with "model": PATH)')
        parser.add_argument("--pooler-config", "--override-pooler-config", dest="pooler_config", type=_json_object,
                            default=EngineArgs.pooler_config,
                            help='embedding pooling as JSON, vLLM\'s PoolerConfig: {"pooling_type": "LAST" | "MEAN" '
                                 '| "CLS", "normalize": true | false} (default: LAST, normalized)')
        parser.add_argument("--pooling", default=EngineArgs.pooling, type=str.lower,
                            choices=[t.lower() for t in POOLING_TYPES],
                            help="shorthand for --pooler-config's pooling_type: last, mean or cls")
        parser.add_argument("--enable-lora", action=argparse.BooleanOptionalAction, default=EngineArgs.enable_lora,
                            help="serve PEFT LoRA adapters per request over the base model (one rank)")
        parser.add_argument("--lora-modules", nargs="+", action="extend", default=EngineArgs.lora_modules,
                            metavar="NAME=PATH", help="LoRA adapters to serve from the start, as model NAME")
        parser.add_argument("--max-loras", type=int, default=EngineArgs.max_loras,
                            help="LoRA adapters served at once (and kept loaded in the worker, least recently "
                                 "used evicted)")
        parser.add_argument("--max-lora-rank", type=int, default=EngineArgs.max_lora_rank,
                            help="the highest LoRA rank an adapter may have")
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"invalid JSON {text!r}: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
               "g": 10**9, "gb": 10**9, "gib": 2**30}


def parse_size(text: str) -> int:
    """'4GiB', '512MB', '1.5g' or a plain byte count -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: use e.g. 4GiB, 512MB or a number of bytes")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def _int_or_auto(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of sequences or 'auto', got {text!r}") from None
