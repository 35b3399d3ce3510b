"""Fixtures shared by the worker tests."""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch


@pytest.fixture
def same_bytes() -> Callable[[torch.Tensor, torch.Tensor], bool]:
    """torch.equal over the tensors' bytes: also for 8-bit float caches, which torch.equal does not take."""
    return lambda a, b: torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
