"""The step's adapter rows, set by the model runner around the forward pass and read by the linear layers (vLLM's
set_forward_context / punica wrapper): each layer with adapter weights adds, for the rows of each adapter, its
low-rank delta in float32, y += (x A^T) B^T (the scaling is folded into B). Thread-local: data-parallel replicas in
one process run their own steps."""
from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:  # weights.py imports the linear layers, which import this module
    from pagellm.lora.weights import LoRAModel


@dataclass(frozen=True)
class LoRAGroup:
    adapter: LoRAModel
    # The batch's token rows that run with this adapter: None for all, a slice when contiguous, else their indices.
    rows: slice | torch.Tensor | None


@dataclass(frozen=True)
class LoRABatch:
    groups: list[LoRAGroup]

    def add_deltas(self, layer: nn.Module, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        x2, out2 = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])
        for group in self.groups:
            weights = group.adapter.layers.get(layer)
            if weights is None:
                continue
            rows = group.rows
            xs = x2 if rows is None else x2[rows]
            shrunk = (xs if xs.dtype == torch.float32 else xs.float()) @ weights.a_t
            if out.dtype == torch.float32 and not isinstance(rows, torch.Tensor):
                (out2 if rows is None else out2[rows]).addmm_(shrunk, weights.b_t)  # in place, no delta tensor
            elif not isinstance(rows, torch.Tensor):
                (out2 if rows is None else out2[rows]).add_((shrunk @ weights.b_t).to(out.dtype))
            else:
                out2.index_add_(0, rows, (shrunk @ weights.b_t).to(out.dtype))
        return out

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
