"""The step's adapter rows, set by the model runner around the forward pass and read by the linear layers (vLLM's
set_forward_context / punica wrapper). Each layer with adapter weights adds every row's own low-rank delta in
float32 with two matmuls whatever the number of adapters in the batch: the step's adapters' A's side by side,
y += ((x [A_1^T | A_2^T | ...]) * mask) [B_1; B_2; ...]^T, where the mask keeps, for each row, the rank columns of
its own adapter (none for base-model rows); B carries the scaling. The fused CPU decode step reads the adapters'
slots and each row's slot instead (models/fused_cpu_decoder.py). Thread-local: data-parallel replicas in one process
run their own steps."""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:  # weights.py imports the linear layers, which import this module
    from pagellm.lora.weights import LoRAModel, StackedLoRA


@dataclass
class LoRABatch:
    # The step's adapters stacked for a layer (None: none of them changes it), cached for the adapters' set.
    stacked: Callable[[nn.Module], StackedLoRA | None]
    # Each token row's adapter (its position in the step's adapter set; -1: the base model), or None when every row
    # runs with the one adapter.
    row_adapter: torch.Tensor | None
    # The worker's adapter slots (None: empty) and each token row's slot (-1: the base model; int32 on the CPU), for
    # the fused CPU decode step, which holds the slots' weights until a slot's adapter changes.
    slots: tuple[LoRAModel | None, ...] = ()
    row_slot: torch.Tensor | None = None
    _masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def add_deltas(self, layer: nn.Module, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        weights = self.stacked(layer)
        if weights is None:
            return out
        x2, out2 = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])
        shrunk = (x2 if x2.dtype == torch.float32 else x2.float()) @ weights.a_t
        if self.row_adapter is not None:
            shrunk *= self._mask(weights.owner)
        if out.dtype == torch.float32:
            out2.addmm_(shrunk, weights.b_t)  # in place: no delta tensor
        else:
            out2.add_((shrunk @ weights.b_t).to(out.dtype))
        return out

    def _mask(self, owner: torch.Tensor) -> torch.Tensor:
        """[rows, rank columns]: 1 where the column belongs to the row's adapter (one per column layout)."""
        mask = self._masks.get(id(owner))
        if mask is None:
            assert self.row_adapter is not None
            mask = self._masks[id(owner)] = (self.row_adapter[:, None] == owner[None, :]).float()
        return mask


_state = threading.local()


def current() -> LoRABatch | None:
    """The running step's adapter rows; None when no row of the batch has an adapter."""
    return getattr(_state, "batch", None)


@contextmanager
def lora_batch(batch: LoRABatch | None) -> Iterator[None]:
    _state.batch = batch
    try:
        yield
    finally:
        _state.batch = None
