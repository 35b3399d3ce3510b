"""PagedAttention over a flattened batch: K/V written into cache blocks by slot, read back by block table.

The batch is laid out decodes first (one query token each), then prefill chunks. Decodes run as one batched
attention that reads each sequence's blocks through its block table; each prefill chunk attends causally to its
own tokens and to the earlier chunks already in the cache. No padding of the token dimension anywhere. The cache
may hold a narrower type than the model computes in (`--kv-cache-dtype`): K and V are rounded to it when written
and widened back when read.

How is up to a backend, one class per file behind `AttentionBackend` (backend.py): `c_backend.py` (the C kernels,
CPU float32), `triton_backend.py` (CUDA, or Triton's interpreter on the CPU; every prefill chunk in one launch),
`torch_backend.py` (PyTorch over gathered blocks and SDPA, everywhere). `selector.py` registers them and picks one
per (device, dtype), once; `layer.py` is the `Attention` module that calls it.
"""
from pagellm.model_executor.layers.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    PrefillChunk,
    PrefillLayout,
)
from pagellm.model_executor.layers.attention.layer import (
    Attention,
    assign_kv_groups,
    layer_sliding_window,
    layer_windows,
)
from pagellm.model_executor.layers.attention.selector import (
    BACKENDS,
    attention_backend,
    check_kv_cache_dtype,
    select_backend,
)
from pagellm.model_executor.layers.attention.torch_backend import reshape_and_cache
from pagellm.model_executor.layers.attention.triton_backend import (
    PREFILL_BLOCK_M,
    PrefillBatch,
    TritonAttentionMetadata,
)

__all__ = [
    "BACKENDS",
    "PREFILL_BLOCK_M",
    "Attention",
    "AttentionBackend",
    "AttentionMetadata",
    "PrefillBatch",
    "PrefillChunk",
    "PrefillLayout",
    "TritonAttentionMetadata",
    "assign_kv_groups",
    "attention_backend",
    "check_kv_cache_dtype",
    "layer_sliding_window",
    "layer_windows",
    "reshape_and_cache",
    "select_backend",
]
