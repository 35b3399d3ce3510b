"""Host data onto the device without waiting for it: on CUDA through pinned memory with a non-blocking copy, a
step's many small integer arrays merged into one transfer (`StagedCopy`).

A copy from pageable host memory synchronizes the stream: built while the device still runs the previous step
(async scheduling), any such copy would make the host wait for that step and undo the overlap.
"""
from __future__ import annotations

import numpy as np
import torch


def to_device(data: torch.Tensor | np.ndarray, device: torch.device | str) -> torch.Tensor:
    """A host tensor or array on `device` (the same tensor on the CPU)."""
    tensor = torch.from_numpy(data) if isinstance(data, np.ndarray) else data
    if torch.device(device).type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def tensor_on(values, dtype: torch.dtype | None, device: torch.device | str) -> torch.Tensor:
    """torch.tensor(values, dtype=dtype) on `device`, copied without synchronizing."""
    return to_device(torch.tensor(values, dtype=dtype), device)


class StagedCopy:
    """A step's integer host arrays sent to the device together: on CUDA gathered into one buffer and sent in a
    single pinned, non-blocking copy, instead of one small transfer each (`send` returns each array as a view of the
    device buffer, in the order added); on the CPU, where there is nothing to transfer, each array as it is. In the
    buffer each array starts a multiple of 16 bytes in: Triton compiles a kernel once per pattern of pointer
    arguments divisible by 16, so views at step-dependent offsets would compile new variants while serving."""

    ALIGN = 2  # int64 elements: 16 bytes

    def __init__(self) -> None:
        self._arrays: list[np.ndarray] = []

    def add(self, array) -> int:
        """Queue `array` (anything NumPy turns into integers); returns its index in `send`'s result."""
        self._arrays.append(np.ascontiguousarray(array, dtype=np.int64))
        return len(self._arrays) - 1

    def send(self, device: torch.device, merge: bool | None = None) -> list[torch.Tensor]:
        """The arrays as int64 tensors on `device`; `merge` (default: off the CPU) sends them as one buffer."""
        if not (device.type != "cpu" if merge is None else merge):
            return [torch.from_numpy(array) for array in self._arrays]
        starts = np.cumsum([0] + [-(-array.size // self.ALIGN) * self.ALIGN for array in self._arrays])
        flat = np.zeros(starts[-1], np.int64)
        for start, array in zip(starts, self._arrays):
            flat[start:start + array.size] = array.reshape(-1)
        merged = to_device(flat, device)
        return [merged[start:start + array.size].view(array.shape) for start, array in zip(starts, self._arrays)]
