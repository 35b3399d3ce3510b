"""Fixtures shared by the kernel tests."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(params=[1, 2], ids=lambda t: f"{t}threads")
def threads(request):
    """The test runs with this many OpenMP threads (the kernels split their work by it); restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)
