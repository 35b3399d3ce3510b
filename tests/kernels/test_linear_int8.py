"""The int8-activation path of the packed-weight kernel (kernels/linear_int8.inc, `--quantize-activations`) against
NumPy: the activations rounded to int8 as documented (per 32 values for 32-weight types, per 256 for K-quants,
scale max|x| / 127, round to nearest even), times the gguf package's dequantized weights in float64; offsets and
minimums with the exact activation sums."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from test_linear_cpu import K_TYPES, TYPES, encode

from pagellm.kernels import linear as kernels

BLOCK_TYPES = [t for t in TYPES if t not in (QT.F32, QT.F16, QT.BF16)]  # int8 activations: packed weights only
# Where a block's quants are, for the types whose offset or minimum the kernel keeps exact (the other bytes are d,
# m and the K-quant scales); with the quants zeroed, gguf's dequantizer gives that term alone.
QUANTS = {QT.Q4_0: slice(2, None), QT.Q4_1: slice(4, None), QT.Q5_0: slice(2, None), QT.Q5_1: slice(4, None),
          QT.Q4_K: slice(16, None), QT.Q5_K: slice(16, None), QT.Q2_K: slice(16, 80)}


@pytest.fixture(autouse=True)
def avx2():
    assert kernels.available(), "the C kernel must build on the test machine (gcc is required)"
    kernels.use_avx2.cache_clear()
    if not kernels.use_avx2():
        pytest.skip("the int8 path needs AVX2")
    yield
    kernels.use_avx2.cache_clear()


def int8_activations(x: np.ndarray, group: int) -> np.ndarray:
    """x as the kernel rounds it, back in float: q * scale per group."""
    rows = x.reshape(x.shape[0], -1, group).astype(np.float32)
    amax = np.abs(rows).max(axis=-1, keepdims=True)
    inverse = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    levels = np.rint(rows * inverse)  # float32 product, ties to even: the kernel's vcvtps2dq
    return (levels.astype(np.float64) * (amax / np.float32(127)).astype(np.float64)).reshape(x.shape)


def int8_reference(x: np.ndarray, packed: np.ndarray, qtype: QT, columns: int) -> np.ndarray:
    def dequantize(blocks: np.ndarray) -> np.ndarray:
        return gguf.quants.dequantize(blocks, qtype).reshape(packed.shape[0], columns).astype(np.float64)

    weight = dequantize(packed)
    exact_part = np.zeros_like(weight)  # the offset or minimum term, multiplied with the exact activations
    if qtype in QUANTS:
        block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
        blocks = packed.reshape(-1, block_bytes).copy()
        blocks[:, QUANTS[qtype]] = 0
        exact_part = dequantize(blocks.reshape(packed.shape))
    rounded = int8_activations(x, 256 if qtype in K_TYPES else 32)
    return rounded @ (weight - exact_part).T + x.astype(np.float64) @ exact_part.T


def int8_matmul(packed: np.ndarray, qtype: QT, in_features: int) -> kernels.PackedMatmul:
    matmul = kernels.PackedMatmul(torch.from_numpy(packed.copy()), qtype, in_features)
    matmul.int8_activations = True
    return matmul


def packed_matrix(qtype: QT, out_features: int, in_features: int, seed: int = 0) -> np.ndarray:
    weight = np.random.default_rng(seed).standard_normal((out_features, in_features)).astype(np.float32)
    return encode(weight, qtype)


@pytest.mark.parametrize("qtype", BLOCK_TYPES + K_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_int8_activations_match_numpy(qtype, rows):
    in_features = 512
    packed = packed_matrix(qtype, 40, in_features)
    x = np.random.default_rng(rows).standard_normal((rows, in_features)).astype(np.float32)
    x[0, :32] *= 50  # one loud block: per-block scales keep the others fine
    matmul = int8_matmul(packed, qtype, in_features)
    assert matmul.int8_activations
    got = matmul(torch.from_numpy(x)).numpy().astype(np.float64)
    want = int8_reference(x, packed, qtype, in_features)
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * scale)
    # ... and that is not the exact product: the int8 path ran
    exact = x.astype(np.float64) @ gguf.quants.dequantize(packed, qtype).reshape(40, in_features).astype(np.float64).T
    assert np.abs(got - exact).max() > 1e-4 * scale


@pytest.mark.parametrize("rows", [5, 8, 48])
def test_several_kernel_calls_per_matmul(rows):
    """Above four activation rows the kernel runs four at a time."""
    qtype, in_features = QT.Q6_K, 256
    packed = packed_matrix(qtype, 12, in_features)
    x = np.random.default_rng(rows).standard_normal((rows, in_features)).astype(np.float32)
    matmul = int8_matmul(packed, qtype, in_features)
    want = int8_reference(x, packed, qtype, in_features)
    np.testing.assert_allclose(matmul(torch.from_numpy(x)).numpy(), want, rtol=0, atol=2e-6 * np.abs(want).max())


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [49, 70, 517])
def test_k_quants_use_int8_activations_at_every_length(qtype, rows, threads):
    """K-quants keep the int8 path above 48 rows (prefill), row counts that are no multiple of four included, and
    in passes of 256 rows beyond (the last one short)."""
    in_features, out_features = 512, 37
    packed = packed_matrix(qtype, out_features, in_features, seed=rows)
    x = np.random.default_rng(rows).standard_normal((rows, in_features)).astype(np.float32)
    got = int8_matmul(packed, qtype, in_features)(torch.from_numpy(x)).numpy().astype(np.float64)
    want = int8_reference(x, packed, qtype, in_features)
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * scale)
    exact = x.astype(np.float64) @ gguf.quants.dequantize(packed, qtype).reshape(out_features, in_features).T
    assert np.abs(got - exact).max() > 1e-4 * scale


def test_rows_outside_the_groups_and_large_batches_stay_exact():
    """A block-type matrix's last n % 4 rows (outside the interleaved groups) and, for the 32-weight types,
    batches above 48 rows take the float path."""
    qtype, in_features = QT.Q4_1, 96
    packed = packed_matrix(qtype, 7, in_features)
    weight = gguf.quants.dequantize(packed, qtype).reshape(7, in_features).astype(np.float64)
    matmul = int8_matmul(packed, qtype, in_features)
    x = np.random.default_rng(1).standard_normal((49, in_features)).astype(np.float32)
    decode = matmul(torch.from_numpy(x[:1])).numpy().astype(np.float64)
    np.testing.assert_allclose(decode[:, 4:], x[:1].astype(np.float64) @ weight[4:].T, rtol=0, atol=1e-5)
    np.testing.assert_allclose(decode[:, :4], int8_reference(x[:1], packed, qtype, in_features)[:, :4], atol=1e-5)
    batch = matmul(torch.from_numpy(x)).numpy().astype(np.float64)
    np.testing.assert_allclose(batch, x.astype(np.float64) @ weight.T, rtol=0, atol=1e-5)


def test_stack_parts_follow_the_switch():
    in_features = 256
    parts = [kernels.PackedMatmul(torch.from_numpy(packed_matrix(t, n, in_features, seed=n)), t, in_features)
             for t, n in ((QT.Q4_K, 8), (QT.Q6_K, 4))]
    stack = kernels.PackedMatmul.stack(parts)
    x = np.random.default_rng(2).standard_normal((1, in_features)).astype(np.float32)
    exact = stack(torch.from_numpy(x)).numpy()
    stack.int8_activations = True
    assert all(part.int8_activations for part in stack.parts)
    got = stack(torch.from_numpy(x)).numpy().astype(np.float64)
    want = np.concatenate([int8_reference(x, part.weight.numpy(), t, in_features)
                           for part, t in zip(stack.parts, (QT.Q4_K, QT.Q6_K))], axis=1)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())
    stack.int8_activations = False
    np.testing.assert_array_equal(stack(torch.from_numpy(x)).numpy(), exact)


def test_silent_input_gives_zero():
    """An all-zero block has scale 0 (no division by zero); the result is exactly the bias-free zero."""
    packed = packed_matrix(QT.Q6_K, 4, 256)
    matmul = int8_matmul(packed, QT.Q6_K, 256)
    assert not matmul(torch.zeros(1, 256)).any()
