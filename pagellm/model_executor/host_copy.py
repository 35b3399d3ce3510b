"""Host data onto the device without waiting for it: on CUDA through pinned memory with a non-blocking copy.

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
