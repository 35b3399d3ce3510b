"""`EngineConfig`, the configs one engine is built from, and the two feature configs small enough to sit beside it:
`StructuredOutputsConfig` (JSON-schema strictness, the reasoning parser) and `LoRAConfig` (multi-LoRA)."""
from __future__ import annotations

from dataclasses import dataclass, field

from pagellm.config.cache import CacheConfig
from pagellm.config.model import DeviceConfig, ModelConfig
from pagellm.config.parallel import ParallelConfig
from pagellm.config.scheduler import SchedulerConfig


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
