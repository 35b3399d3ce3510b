"""The attention backend registry and `select_backend`: which backend each device and dtype gets, the
PAGELLM_ATTENTION_BACKEND override, the one choice per process, and each backend's own metadata."""
from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
import torch

from pagellm.kernels import paged_attention as cpu_kernels
from pagellm.model_executor.host_copy import StagedCopy
from pagellm.model_executor.layers.attention import (
    BACKENDS,
    AttentionMetadata,
    PrefillLayout,
    TritonAttentionMetadata,
    select_backend,
    selector,
)


@pytest.fixture(autouse=True)
def fresh_choice(monkeypatch):
    """Each test chooses afresh, and leaves the process's choice (and TRITON_INTERPRET) as it found them."""
    monkeypatch.delenv("PAGELLM_ATTENTION_BACKEND", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    selector._select.cache_clear()
    yield
    selector._select.cache_clear()


def test_registry_names_its_backends_and_only_c_carries_the_fused_decoder():
    assert list(BACKENDS) == ["c", "triton", "torch"]  # order of preference: PyTorch, which runs anywhere, last
    assert all(cls.name == name for name, cls in BACKENDS.items())
    assert [name for name, cls in BACKENDS.items() if cls.supports_fused_decoder] == ["c"]


def test_cpu_float32_gets_the_c_kernels_when_they_build():
    expected = "c" if cpu_kernels.load() is not None else "torch"
    assert select_backend("cpu", torch.float32).name == expected


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_half_precision_gets_pytorch(dtype):
    assert select_backend("cpu", dtype).name == "torch"


def test_cuda_gets_triton_where_it_is_installed():
    expected = "triton" if importlib.util.find_spec("triton") is not None else "torch"
    assert select_backend(torch.device("cuda", 0), torch.bfloat16).name == expected


def test_chosen_once_and_shared():
    backend = select_backend(torch.device("cpu"), torch.float32)
    assert select_backend("cpu", torch.float32) is backend


@pytest.mark.parametrize("forced", ["torch", "triton"])
def test_environment_overrides_the_choice(forced, monkeypatch):
    monkeypatch.setenv("PAGELLM_ATTENTION_BACKEND", forced)
    assert select_backend("cpu", torch.float32).name == forced
    # Triton on the CPU runs its interpreter, switched on before the kernels are defined.
    assert (os.environ.get("TRITON_INTERPRET") == "1") == (forced == "triton")


def test_an_unknown_override_is_refused(monkeypatch):
    monkeypatch.setenv("PAGELLM_ATTENTION_BACKEND", "flash")
    with pytest.raises(ValueError, match="PAGELLM_ATTENTION_BACKEND must be"):
        select_backend("cpu", torch.float32)


def layout() -> PrefillLayout:
    """Two prefill chunks behind one decode row: 5 fresh tokens, then 3 tokens after 4 cached ones."""
    return PrefillLayout(query_starts=np.array([1, 6]), query_lens=np.array([5, 3]), context_lens=np.array([0, 4]),
                         block_tables=np.array([[2, 0], [5, 6]]), block_ids=[[2], [5, 6]])


@pytest.mark.parametrize("name", ["c", "torch"])
def test_per_chunk_backends_build_one_table_per_chunk(name):
    backend, staged = BACKENDS[name](), StagedCopy()
    handles = backend.stage_prefills(staged, layout())
    sent = staged.send(torch.device("cpu"))
    meta = backend.build_metadata(torch.arange(9), 1, None, None, layout(), [sent[h] for h in handles])
    assert type(meta) is AttentionMetadata
    assert [(c.query_start, c.query_len, c.context_len, c.block_ids.tolist()) for c in meta.prefills] == [
        (1, 5, 0, [2]), (6, 3, 4, [5, 6])]


def test_triton_metadata_carries_the_prefill_batch():
    backend, staged = BACKENDS["triton"](), StagedCopy()
    handles = backend.stage_prefills(staged, layout())
    sent = staged.send(torch.device("cpu"))
    meta = backend.build_metadata(torch.arange(9), 1, None, None, layout(), [sent[h] for h in handles])
    assert isinstance(meta, TritonAttentionMetadata)
    assert [(c.query_start, c.query_len, c.context_len, c.block_ids) for c in meta.prefills] == [
        (1, 5, 0, None), (6, 3, 4, None)]
    batch = meta.prefill_batch
    assert batch.block_tables.tolist() == [[2, 0], [5, 6]] and batch.query_starts.tolist() == [0, 5]
    empty = PrefillLayout(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64),
                          np.zeros((0, 1), np.int64), [])
    assert backend.stage_prefills(StagedCopy(), empty) == []
    assert backend.build_metadata(torch.arange(1), 1, None, None, empty, []).prefill_batch is None
