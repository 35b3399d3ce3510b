"""A step's output whose sampled tokens are still on the device (async scheduling): the copy to host memory is
queued behind the step's kernels, and only `get` waits for it, so the engine can schedule and submit the next
step first."""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagellm.worker.model_runner import ModelRunnerOutput


class AsyncModelRunnerOutput:
    def __init__(self, sampled: torch.Tensor, finish: Callable[[list[int]], ModelRunnerOutput]) -> None:
        """`sampled`: the step's sampled token ids (one per logits row); `finish` builds the output from them."""
        self._finish = finish
        # Speculative method draft_model: the drafts the worker's draft model made for the step (worker.py).
        self.draft_token_ids: dict[str, list[int]] = {}
        self._ready: torch.cuda.Event | None = None
        if sampled.device.type == "cuda":
            self._host = torch.empty(sampled.shape, dtype=sampled.dtype, pin_memory=True)
            self._host.copy_(sampled, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host = sampled

    def get(self) -> ModelRunnerOutput:
        """Wait for the copy (not for later steps) and build the output."""
        if self._ready is not None:
            self._ready.synchronize()
        output = self._finish(self._host.tolist())
        if self.draft_token_ids:
            output.draft_token_ids = self.draft_token_ids
        return output
