"""The binding of `decoder_cpu.c`: the decoder layers of a Llama-family or Gemma 3 model in one C call per decode
step, for float32 on the CPU.

Owns the C library's ctypes signatures (`SIGNATURES`), the mirrors of its structs (`_Layer`, `_Decoder`, `_LoRA`)
and `FusedDecoder`, which the model builds from its layers' kernels and weights (`LayerWeights`) and into which LoRA
adapters are set per slot (`set_lora`). The C side strings together the same kernels the PyTorch modules call,
reached through function pointers into the other three libraries, so the two paths compute the same thing (tests
compare them)."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from pagellm.kernels import elementwise, linear, paged_attention
from pagellm.kernels.build import Signature, isa_flags, load_library

SOURCE = Path(__file__).with_name("decoder_cpu.c")
_FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-fPIC", "-shared", "-std=c11"]
_I64, _F32, _PTR, _INT = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int

# Every exported function of decoder_cpu.c, under the prototype it mirrors (tests/kernels/test_bindings.py checks
# both ways).
SIGNATURES: dict[str, Signature] = {
    # int pagellm_decoder_forward(const pagellm_decoder *d, float *hidden, int64_t m, const int64_t *positions,
    #                             const int64_t *slots, const int64_t *block_tables, int64_t max_blocks,
    #                             const int64_t *seq_lens, const int32_t *row_slot, int nthreads);
    "pagellm_decoder_forward": (_INT, [_PTR, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _INT]),
}


# Mirrors decoder_cpu.c's pagellm_decoder_layer, field for field.
class _Layer(ctypes.Structure):
    _fields_ = [*((name, _PTR) for name in (
        "qkv", "o", "gate_up", "down", "qkv_bias", "o_bias", "gate_up_bias", "down_bias",
        "input_norm", "mlp_norm", "q_norm", "k_norm", "attn_out_norm", "mlp_out_norm", "cos_table", "sin_table",
        "key_cache", "value_cache")),
        ("sliding_window", _I64), ("kv_group", _I64)]


# Mirrors decoder_cpu.c's pagellm_decoder_lora: one adapter on one projection of one layer (rank 0: none); its B
# in blocks of _LORA_COLS outputs (decoder_cpu.c's LORA_MAX_PARTS and LORA_COLS).
_LORA_MAX_PARTS, _LORA_COLS = 3, 64


class _LoRA(ctypes.Structure):
    _fields_ = [("a", _PTR), ("b", _PTR), ("rank", _I64), ("num_parts", _I64),
                *((name, _I64 * _LORA_MAX_PARTS) for name in ("part_rank", "part_out", "part_size"))]


# The projections an adapter may change, in decoder_cpu.c's order (LORA_QKV ...).
LORA_PROJECTIONS = ("qkv", "o", "gate_up", "down")


# Mirrors decoder_cpu.c's pagellm_decoder; the function pointers are addresses in the other kernels' libraries.
class _Decoder(ctypes.Structure):
    _fields_ = [*((name, _PTR) for name in ("matmul", "rms_norm", "act_and_mul", "rope", "write_cache",
                                             "attention")),
                *((name, _I64) for name in ("hidden", "heads", "kv_heads", "head_dim", "intermediate", "num_blocks",
                                            "block_size", "num_layers", "kv_type")),
                ("eps", _F32), ("scale", _F32), ("layers", ctypes.POINTER(_Layer)),
                ("lora", ctypes.POINTER(_LoRA)), ("lora_slots", _I64), ("lora_max_rank", _I64)]

# The MLP activations the C side has, by the name FusedDecoder takes.
ACTIVATIONS = {"silu": "silu_and_mul_f32", "gelu_tanh": "gelu_tanh_and_mul_f32"}


@cache
def load() -> ctypes.CDLL | None:
    # Without any one of the kernels it strings together there is nothing to point at: no fused step.
    parts = [linear.load(), elementwise.load(), paged_attention.load()]
    if None in parts:
        return None
    return load_library(SOURCE, _FLAGS + isa_flags(), "the fused CPU decode step", SIGNATURES)


def loaded() -> ctypes.CDLL:
    """The library, for callers that know it loads (they checked `load()` first)."""
    library = load()
    assert library is not None, "check load() first and use the PyTorch path when it returns None"
    return library


def _address(function) -> int:
    address = ctypes.cast(function, _PTR).value
    assert address is not None
    return address


@dataclass
class LayerWeights:
    """One decoder layer's kernels and float tensors (biases, norms: None when the model has none), its RoPE tables
    (RotaryEmbedding's cos/sin caches; None: the layer attends without positions) and its attention's sliding window
    (None: the whole sequence).

    `input_norm` and `mlp_norm` normalise the attention's and the MLP's inputs (Llama's input_layernorm and
    post_attention_layernorm); `attn_out_norm` and `mlp_out_norm` normalise their outputs before the residual adds
    (Gemma 3's post-norms)."""
    qkv: linear.PackedMatmul
    o: linear.PackedMatmul
    gate_up: linear.PackedMatmul
    down: linear.PackedMatmul
    input_norm: torch.Tensor
    mlp_norm: torch.Tensor
    cos_table: torch.Tensor | None
    sin_table: torch.Tensor | None
    qkv_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None
    sliding_window: int | None = None
    kv_group: int = 0  # its KV cache group: which of `forward`'s slot mappings and block tables it reads
    # The layer's qkv, o, gate_up and down modules (LORA_PROJECTIONS' order): what a LoRA adapter's weights are
    # found under (models/fused_cpu_decoder.py); empty where adapters do not apply.
    lora_targets: tuple[torch.nn.Module, ...] = ()


class FusedDecoder:
    """Runs every decoder layer for a batch of decoding sequences in one call."""

    def __init__(self, layers: list[LayerWeights], *, hidden: int, heads: int, kv_heads: int, head_dim: int,
                 intermediate: int, eps: float, scale: float, activation: str = "silu") -> None:
        self._weights = layers  # keeps every tensor the C side points at alive
        self._layers = (_Layer * len(layers))()
        for struct, w in zip(self._layers, layers):
            for name in ("qkv", "o", "gate_up", "down"):
                setattr(struct, name, getattr(w, name).pointer)
            for name in ("qkv_bias", "o_bias", "gate_up_bias", "down_bias", "input_norm", "mlp_norm", "q_norm",
                         "k_norm", "attn_out_norm", "mlp_out_norm", "cos_table", "sin_table"):
                tensor = getattr(w, name)
                setattr(struct, name, None if tensor is None else tensor.data_ptr())
            struct.sliding_window, struct.kv_group = w.sliding_window or 0, w.kv_group
        lib_linear, lib_elementwise, lib_attention = linear.loaded(), elementwise.loaded(), paged_attention.loaded()
        self._decoder = _Decoder(
            _address(lib_linear.pagellm_matmul), _address(lib_elementwise.rms_norm_f32),
            _address(getattr(lib_elementwise, ACTIVATIONS[activation])), _address(lib_elementwise.rope_f32),
            _address(lib_attention.reshape_and_cache), _address(lib_attention.paged_decode_attention),
            hidden, heads, kv_heads, head_dim, intermediate, 0, 0, len(layers), 0, eps, scale, self._layers)
        self._caches: list[torch.Tensor] | None = None
        self._run = loaded().pagellm_decoder_forward
        self._lora = (_LoRA * 0)()
        self._lora_weights: dict[tuple[int, int, int], tuple[torch.Tensor, ...]] = {}  # what the table points at

    @property
    def layers(self) -> list[LayerWeights]:
        return self._weights

    def set_lora_slots(self, count: int) -> None:
        """Make room for `count` adapter slots (those beyond the old count start empty; the others keep theirs)."""
        old, layers = self._decoder.lora_slots, len(self._weights)
        if count == old:
            return
        table = (_LoRA * (layers * count * len(LORA_PROJECTIONS)))()
        width = len(LORA_PROJECTIONS)
        for layer in range(layers):
            for slot in range(min(old, count)):
                start = (layer * count + slot) * width
                table[start:start + width] = self._lora[(layer * old + slot) * width:(layer * old + slot + 1) * width]
        self._lora_weights = {key: w for key, w in self._lora_weights.items() if key[1] < count}
        self._lora = table
        self._decoder.lora, self._decoder.lora_slots = table, count

    def set_lora(self, slot: int, layer: int, projection: int,
                 weights: tuple[torch.Tensor, torch.Tensor, tuple[tuple[int, int, int], ...]] | None) -> None:
        """The adapter in `slot` on `projection` (an index into LORA_PROJECTIONS) of `layer`, or None: it has none.
        `weights` is (a, b_t, parts), float32 on the CPU: delta = (x a^T) b_t, where `a` [rank, in] stacks the A's
        of the projection's parts and `b_t` [rank, out] is (scaling B)^T, block-diagonal: part i's `parts[i][0]`
        rank rows (after the earlier parts') write its outputs [parts[i][1], parts[i][1] + parts[i][2]) only. Those
        blocks are copied in the C side's layout (each part's in blocks of _LORA_COLS outputs, each block contiguous,
        so a work item streams one), kept here while the slot holds them."""
        entry = self._lora[(layer * self._decoder.lora_slots + slot) * len(LORA_PROJECTIONS) + projection]
        key = (layer, slot, projection)
        if weights is None:
            ctypes.memset(ctypes.addressof(entry), 0, ctypes.sizeof(entry))
            self._lora_weights.pop(key, None)
            return
        a, b_t, parts = weights
        assert a.dtype == b_t.dtype == torch.float32 and a.is_contiguous() and b_t.is_contiguous()
        assert len(parts) <= _LORA_MAX_PARTS and sum(p[0] for p in parts) == a.shape[0] == b_t.shape[0]
        blocks, row = [], 0
        for rank, out, size in parts:
            part = b_t[row:row + rank, out:out + size]
            blocks += [part[:, o:o + _LORA_COLS].flatten() for o in range(0, size, _LORA_COLS)]
            row += rank
        b = torch.cat(blocks)
        entry.a, entry.b, entry.rank, entry.num_parts = a.data_ptr(), b.data_ptr(), a.shape[0], len(parts)
        for i, (rank, out, size) in enumerate(parts):
            entry.part_rank[i], entry.part_out[i], entry.part_size[i] = rank, out, size
        self._lora_weights[key] = (a, b)
        self._decoder.lora_max_rank = max(self._decoder.lora_max_rank, a.shape[0])

    def _bind(self, kv_caches: list[torch.Tensor]) -> None:
        """Point the layers at this KV cache ([2, Hkv, num_blocks, block_size, D] per layer, any of
        `paged_attention.KV_TYPES`)."""
        for struct, cache_tensor in zip(self._layers, kv_caches):
            struct.key_cache, struct.value_cache = cache_tensor[0].data_ptr(), cache_tensor[1].data_ptr()
        self._decoder.num_blocks, self._decoder.block_size = kv_caches[0].shape[2], kv_caches[0].shape[3]
        self._decoder.kv_type = paged_attention.KV_TYPES[kv_caches[0].dtype]
        self._caches = kv_caches

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                row_slot: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [m, hidden] (updated in place and returned); one query token per sequence. slot_mapping [m] and
        block_tables [m, max_blocks], or [groups, m] and [groups, m, max_blocks] with several KV cache groups (each
        layer reads its `kv_group`'s). row_slot: int32 [m],
        each row's adapter slot (-1: the base model), or None when no row has an adapter."""
        if kv_caches is not self._caches:
            self._bind(kv_caches)
        hidden = hidden.contiguous()
        status = self._run(ctypes.addressof(self._decoder), hidden.data_ptr(), hidden.shape[0], positions.data_ptr(),
                           slot_mapping.data_ptr(), block_tables.data_ptr(), block_tables.shape[-1],
                           seq_lens.data_ptr(), None if row_slot is None else row_slot.data_ptr(),
                           torch.get_num_threads())
        if status == -2:
            raise MemoryError("the fused decode step could not allocate its scratch buffers")
        if status != 0:
            raise RuntimeError("the fused decode step failed in a kernel")
        return hidden
