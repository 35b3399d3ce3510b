"""Fixtures shared by the LoRA tests."""
from __future__ import annotations

import inspect

import pytest

from pagellm.kernels.decoder import FusedDecoder


@pytest.fixture
def lora_rows_seen(monkeypatch) -> list[list[int]]:
    """Each fused CPU decode step's adapter slot per row, for the steps that ran with adapter rows (the one C call
    added their deltas)."""
    seen: list[list[int]] = []
    forward = FusedDecoder.forward
    signature = inspect.signature(forward)

    def spy(*args, **kwargs):
        row_slot = signature.bind(*args, **kwargs).arguments.get("row_slot")
        if row_slot is not None:
            seen.append(row_slot.tolist())
        return forward(*args, **kwargs)

    monkeypatch.setattr(FusedDecoder, "forward", spy)
    return seen
