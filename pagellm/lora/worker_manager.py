"""The worker's adapters: loaded from their directory on a request's first step, kept by `lora_int_id` (the
`max_loras` most recently used; the step's own adapters are never evicted) each in a slot (the fused CPU decode
step's table of adapter weights, rewritten only when a slot's adapter changes), each step's rows mapped to their
adapter and slot, and each set of adapters that shares a step stacked per layer once (see context.py)."""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from pagellm.config import LoRAConfig
from pagellm.lora.context import LoRABatch
from pagellm.lora.peft import load_peft_adapter
from pagellm.lora.request import LoRARequest
from pagellm.lora.weights import LoRAModel, StackedLoRA, build_lora_model, stack_adapters

_MAX_STACKS = 16  # sets of adapters whose stacked weights are kept


class LoRAWorkerManager:
    def __init__(self, config: LoRAConfig, model: nn.Module, hf_config, device: torch.device) -> None:
        self.config, self.model, self.hf_config, self.device = config, model, hf_config, device
        self.adapters: OrderedDict[int, LoRAModel] = OrderedDict()
        self.slots: list[LoRAModel | None] = []  # a loaded adapter keeps its slot until it is evicted
        self._slot_of: dict[int, int] = {}  # lora_int_id -> its slot
        # adapter ids of a step -> layer -> their stacked weights (None: no adapter of the set changes the layer)
        self._stacks: dict[tuple[int, ...], dict[nn.Module, StackedLoRA | None]] = {}

    def _get(self, request: LoRARequest) -> LoRAModel:
        adapter = self.adapters.get(request.lora_int_id)
        if adapter is None:
            peft = load_peft_adapter(request.lora_path, self.hf_config, self.config.max_lora_rank)
            adapter = self.adapters[request.lora_int_id] = build_lora_model(request.lora_int_id, peft, self.model,
                                                                            self.device)
            if None in self.slots:  # an evicted adapter's
                self._slot_of[request.lora_int_id] = slot = self.slots.index(None)
                self.slots[slot] = adapter
            else:
                self._slot_of[request.lora_int_id] = len(self.slots)
                self.slots.append(adapter)
        self.adapters.move_to_end(request.lora_int_id)
        return adapter

    def batch(self, requests: list[LoRARequest | None], query_lens: np.ndarray) -> LoRABatch | None:
        """The adapter of each token row of a step whose sequences (in the flat batch's order, `query_lens` tokens
        each) run with `requests`; None when none has an adapter."""
        if all(r is None for r in requests):
            return None
        unique = {r.lora_int_id: r for r in requests if r is not None}
        for lora_id in unique.keys() & self.adapters.keys():
            self.adapters.move_to_end(lora_id)
        # Room first, so a new adapter takes an evicted one's slot.
        self._evict(max(self.config.max_loras, len(unique)) - len(unique.keys() - self.adapters.keys()))
        adapters = tuple(self._get(r) for r in unique.values())
        row_adapter = None
        if len(adapters) > 1 or any(r is None for r in requests):
            position = {lora_id: i for i, lora_id in enumerate(unique)}
            per_request = np.array([-1 if r is None else position[r.lora_int_id] for r in requests], dtype=np.int64)
            row_adapter = torch.from_numpy(np.repeat(per_request, query_lens)).to(self.device)
        slot_of = np.array([-1 if r is None else self._slot_of[r.lora_int_id] for r in requests], dtype=np.int32)
        row_slot = torch.from_numpy(np.repeat(slot_of, query_lens))
        key = tuple(unique)
        stacks = self._stacks.get(key)
        if stacks is None:
            if len(self._stacks) >= _MAX_STACKS:
                self._stacks.clear()
            stacks = self._stacks[key] = {}

        def stacked(layer: nn.Module) -> StackedLoRA | None:
            if layer not in stacks:
                stacks[layer] = stack_adapters(adapters, layer)
            return stacks[layer]

        return LoRABatch(stacked, row_adapter, tuple(self.slots), row_slot)

    def _evict(self, keep: int) -> None:
        """Drop the least recently used adapters beyond `keep` (this step's are the most recent)."""
        evicted = list(self.adapters)[:max(0, len(self.adapters) - keep)]
        for lora_id in evicted:
            del self.adapters[lora_id]
            self.slots[self._slot_of.pop(lora_id)] = None
        if evicted:
            self._stacks = {key: stacks for key, stacks in self._stacks.items() if not set(key) & set(evicted)}
