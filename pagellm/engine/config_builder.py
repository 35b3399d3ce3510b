"""EngineArgs -> a validated EngineConfig: each setting resolved against the model (its Hugging Face config, GGUF
file and sentence-transformers modules) and the device (dtype, quantization, runner, pooling, context length,
parallel sizes, encoder-only limits), and every contradiction refused with a ValueError naming the flag to fix. The
settings themselves, as keywords and CLI flags, are EngineArgs (arg_utils.py)."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pagellm.config import (
    RUNNERS,
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    PoolerConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
    resolve_device,
    resolve_dtype,
)
from pagellm.engine.draft_model_config import resolve_draft_model
from pagellm.logger import init_logger
from pagellm.model_executor.layers.quantization import QUANTIZATION_METHODS
from pagellm.model_executor.layers.rotary_embedding import longrope_limit
from pagellm.model_executor.model_loader.gguf_loader import gguf_source
from pagellm.model_executor.model_loader.resolve import DEFAULT_MODEL_NAME, resolve_model_dir
from pagellm.model_executor.models.registry import is_encoder_only, resolve_architecture
from pagellm.transformers_utils.sentence_transformers import (
    SentenceTransformersConfig,
    read_sentence_transformers_config,
)
from pagellm.worker.cpu_affinity import available_cores, slot_groups

if TYPE_CHECKING:
    from pagellm.engine.arg_utils import EngineArgs

logger = init_logger(__name__)


def build_engine_config(args: EngineArgs) -> EngineConfig:
    """The validated EngineConfig of these settings, resolved against the model (its config, GGUF file,
    sentence-transformers modules) and the device; a ValueError names the flag to fix."""
    from transformers import AutoConfig

    device = resolve_device(args.device)
    model_dir = resolve_model_dir(args.model)
    dtype = resolve_dtype(args.dtype, device)
    gguf_file = gguf_source(model_dir)
    hf_config = AutoConfig.from_pretrained(str(model_dir))
    architecture = resolve_architecture(hf_config)
    sentence_config = read_sentence_transformers_config(model_dir)
    max_model_len = _max_model_len(args, hf_config, sentence_config)
    if args.max_logprobs < 0:
        raise ValueError(f"max_logprobs must be non-negative, got {args.max_logprobs}; fix --max-logprobs.")
    pipeline_overlap = device.type == "cuda" if args.pipeline_overlap is None else args.pipeline_overlap
    parallel_config = ParallelConfig(tensor_parallel_size=args.tensor_parallel_size,
                                     pipeline_parallel_size=args.pipeline_parallel_size,
                                     distributed_executor_backend=args.distributed_executor_backend,
                                     data_parallel_size=args.data_parallel_size, pipeline_overlap=pipeline_overlap,
                                     cpu_affinity=args.cpu_affinity)
    if args.cpu_affinity and device.type == "cpu":  # refused here, before any rank starts
        slot_groups(args.cpu_affinity, parallel_config.concurrent_ranks, available_cores())
    check_parallel_sizes(hf_config, parallel_config)
    chunked_prefill, prefix_caching = _encoder_settings(args, architecture, parallel_config)
    if args.async_scheduling and parallel_config.distributed_executor_backend != "uni":
        raise ValueError("--async-scheduling works with one rank in this process (the uni executor); drop it "
                         "or run without tensor/pipeline parallelism.")
    quantization = _quantization(args, device, dtype, gguf_file)
    if args.quantize_activations and quantization == "none":
        raise ValueError("--quantize-activations works on packed weights (--quantization gguf or int8, on the CPU "
                         "in float32); drop it or choose a packed --quantization.")
    model_config = ModelConfig(
        model=str(model_dir),
        tokenizer=str(args.tokenizer or model_dir),
        hf_config=hf_config,
        architecture=architecture,
        dtype=dtype,
        max_model_len=max_model_len,
        seed=args.seed,
        served_model_name=args.served_model_name or (str(args.model) if args.model else DEFAULT_MODEL_NAME),
        max_logprobs=args.max_logprobs,
        quantization=quantization,
        quantize_activations=args.quantize_activations,
        gguf_file=str(gguf_file) if gguf_file else None,
        enforce_eager=args.enforce_eager,
        runner=_runner(args, architecture),
        pooler_config=_pooler_config(args, architecture, sentence_config),
    )
    return EngineConfig(
        model_config=model_config,
        cache_config=CacheConfig(block_size=args.block_size, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                                 gpu_memory_utilization=args.gpu_memory_utilization,
                                 enable_prefix_caching=prefix_caching,
                                 swap_space_bytes=int(args.swap_space * (1 << 30)),
                                 cache_dtype=args.kv_cache_dtype),
        scheduler_config=SchedulerConfig(max_num_seqs=_max_num_seqs(args),
                                         max_num_batched_tokens=args.max_num_batched_tokens,
                                         enable_chunked_prefill=chunked_prefill,
                                         scheduling_policy=args.scheduling_policy,
                                         preemption_mode=args.preemption_mode,
                                         short_first_max_wait=args.short_first_max_wait,
                                         target_tpot_ms=args.target_tpot_ms,
                                         async_scheduling=args.async_scheduling,
                                         speculative_config=resolve_draft_model(
                                             _speculative_config(args), model_config, parallel_config,
                                             device.type == "cpu")),
        device_config=DeviceConfig(device=device),
        parallel_config=parallel_config,
        structured_outputs_config=StructuredOutputsConfig(
            disable_additional_properties=args.structured_outputs_disable_additional_properties,
            reasoning_parser=args.reasoning_parser),
        lora_config=_lora_config(args, parallel_config),
    )


def _lora_config(args: EngineArgs, parallel: ParallelConfig) -> LoRAConfig:
    config = LoRAConfig(enable_lora=args.enable_lora, lora_modules=tuple(args.lora_modules or ()),
                        max_loras=args.max_loras, max_lora_rank=args.max_lora_rank)
    if config.enable_lora and parallel.world_size > 1:  # adapters are applied whole, on one rank
        raise ValueError("--enable-lora runs on one rank: drop --tensor-parallel-size / "
                         "--pipeline-parallel-size, or run without LoRA adapters.")
    return config


def _quantization(args: EngineArgs, device: torch.device, dtype: torch.dtype, gguf_file: Path | None) -> str:
    kernels_apply = device.type == "cpu" and dtype == torch.float32
    if args.quantization is None:
        return "gguf" if gguf_file is not None and kernels_apply else "none"
    if args.quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}, got "
                         f"{args.quantization!r}; fix --quantization.")
    if args.quantization != "none" and not kernels_apply:
        raise ValueError(f"--quantization {args.quantization} runs on the CPU in float32 only (device "
                         f"{device.type}, dtype {str(dtype).removeprefix('torch.')}); use --quantization none.")
    if args.quantization == "gguf" and gguf_file is None:
        raise ValueError("--quantization gguf needs a .gguf model file; for a float checkpoint use "
                         "--quantization int8 or none.")
    return args.quantization


def _runner(args: EngineArgs, architecture: str) -> str:
    if args.runner not in RUNNERS:
        raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {args.runner!r}; fix --runner.")
    if is_encoder_only(architecture):
        if args.runner == "generate":
            raise ValueError(f"{architecture} is an encoder-only model: it computes embeddings, not text. Use "
                             f"--runner pooling (or auto).")
        return "pooling"
    return "generate" if args.runner == "auto" else args.runner


def _encoder_settings(args: EngineArgs, architecture: str, parallel: ParallelConfig) -> tuple[bool, bool]:
    """Chunked prefill and prefix caching for this model. An encoder-only model attends over each whole prompt
    and caches no K/V (layers/attention/encoder.py), so both are off for it, as vLLM turns them off, and it runs
    on one rank without LoRA adapters."""
    if not is_encoder_only(architecture):
        return args.enable_chunked_prefill, args.enable_prefix_caching
    if parallel.world_size > 1 or args.enable_lora:
        raise ValueError(f"{architecture} is an encoder-only model, which runs on one rank without LoRA "
                         f"adapters: drop --tensor-parallel-size, --pipeline-parallel-size and --enable-lora.")
    if args.enable_chunked_prefill or args.enable_prefix_caching:
        logger.info("%s is an encoder-only model: each prompt runs whole in one step and caches no K/V, so "
                    "chunked prefill and prefix caching are off.", architecture)
    return False, False


def _model_pooling(architecture: str, sentence_config: SentenceTransformersConfig | None,
                   with_type: bool) -> dict:
    """The model's own PoolerConfig fields (the pooling type only `with_type`): its sentence-transformers
    modules' pooling and normalisation, as vLLM reads them, else CLS for an encoder (vLLM's BERT default) and
    PoolerConfig's defaults for a causal LM."""
    fields: dict = {"pooling_type": "CLS"} if is_encoder_only(architecture) else {}
    if sentence_config is not None:
        fields["normalize"] = sentence_config.normalize
        if with_type and sentence_config.pooling_type is not None:
            fields["pooling_type"] = sentence_config.pooling_type
    return fields


def _speculative_config(args: EngineArgs) -> SpeculativeConfig | None:
    config = args.speculative_config
    return SpeculativeConfig.from_dict(config) if isinstance(config, dict) else config


def _pooler_config(args: EngineArgs, architecture: str,
                   sentence_config: SentenceTransformersConfig | None) -> PoolerConfig:
    """--pooler-config's fields, and --pooling's pooling_type, over the model's own (_model_pooling)."""
    config = args.pooler_config
    if isinstance(config, PoolerConfig):
        given = {"pooling_type": config.pooling_type, "normalize": config.normalize}
    else:
        given = dict(config or {})
        unknown = set(given) - {"pooling_type", "normalize"}
        if unknown:
            raise ValueError(f"--pooler-config takes pooling_type and normalize, got {', '.join(sorted(unknown))}.")
    if args.pooling is not None:
        if "pooling_type" in given and str(given["pooling_type"]).upper() != args.pooling.upper():
            raise ValueError(f"--pooling {args.pooling} contradicts --pooler-config's pooling_type "
                             f"{given['pooling_type']}; give one of them.")
        given["pooling_type"] = args.pooling
    model = _model_pooling(architecture, sentence_config, with_type="pooling_type" not in given)
    return PoolerConfig(**{**model, **given})


def _max_model_len(args: EngineArgs, hf_config, sentence_config: SentenceTransformersConfig | None = None) -> int:
    # A sliding window (Mistral) does not bound the context: the attention applies it.
    limit = getattr(hf_config, "max_position_embeddings", None) or 2048
    # A sentence-transformers model embeds up to its max_seq_length tokens (vLLM caps the length there too).
    if sentence_config is not None and sentence_config.max_seq_length:
        limit = min(limit, sentence_config.max_seq_length)
    exact = longrope_limit(hf_config)
    if exact is not None and (args.max_model_len or 0) > exact:
        raise ValueError(f"max_model_len ({args.max_model_len}) exceeds this LongRoPE model's "
                         f"original_max_position_embeddings ({exact}): past it transformers switches to the long "
                         f"RoPE factors, which pagellm does not implement; pass --max-model-len {exact} or less.")
    if exact is not None:
        limit = min(limit, exact)
    if args.max_model_len is None:
        return limit
    if not 0 < args.max_model_len <= limit:
        raise ValueError(f"max_model_len ({args.max_model_len}) must be between 1 and the model's limit of "
                         f"{limit} tokens (max_position_embeddings, or sentence_bert_config.json's "
                         f"max_seq_length); lower --max-model-len.")
    return args.max_model_len


def _max_num_seqs(args: EngineArgs) -> int:
    if args.max_num_seqs == "auto":
        if args.target_tpot_ms is None:
            raise ValueError("--max-num-seqs auto lets a latency target size the batch: give --target-tpot-ms "
                             "too (e.g. --target-tpot-ms 50), or a number of sequences.")
        return SchedulerConfig.max_num_seqs
    return int(args.max_num_seqs)


def check_parallel_sizes(hf_config, parallel: ParallelConfig) -> None:
    """Tensor parallelism splits query heads (and KV heads, or replicates them when there are fewer KV heads than
    ranks); pipeline parallelism splits layers. Sizes that do not divide are refused, naming the ones that work."""
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    tp = parallel.tensor_parallel_size

    def divides(size: int) -> bool:
        return heads % size == 0 and (kv_heads % size == 0 if size <= kv_heads else size % kv_heads == 0)

    if not divides(tp):
        working = [size for size in range(1, heads + 1) if divides(size)]
        raise ValueError(f"--tensor-parallel-size {tp} does not divide this model's {heads} attention heads and "
                         f"{kv_heads} KV heads; sizes that work: {', '.join(map(str, working))}.")
    layers = hf_config.num_hidden_layers
    if parallel.pipeline_parallel_size > layers:
        raise ValueError(f"--pipeline-parallel-size {parallel.pipeline_parallel_size} is more than this model's "
                         f"{layers} layers.")
