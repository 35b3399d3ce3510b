"""`LoRARequest`: which adapter a request runs with (vLLM's class and field names)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """`lora_int_id` identifies the adapter (positive; equal ids must mean the same adapter: the worker caches by
    it, and it is part of the prefix-cache key); `lora_path` is a PEFT adapter directory."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}.")
