"""The packed-weight C kernel (kernels/linear_cpu.c) against NumPy: the gguf package's own dequantizer and a
float64 matmul. Every storage type, every instruction path (AVX-512 tiles, AVX2 and the portable scalar fallback),
decode-sized and larger batches, odd shapes and strided activations; and the AVX-512 tiles and small-M kernels against
the AVX2 ones, float for float."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from pagellm.kernels import linear as kernels

TYPES = [QT.F32, QT.F16, QT.BF16, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.IQ4_NL]
K_TYPES = [QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.IQ4_XS]  # 256 weights per super-block


@pytest.fixture(params=["avx512", "avx2", "scalar"])
def isa(request, monkeypatch):
    assert kernels.available(), "the C kernel must build on the test machine (gcc is required)"
    monkeypatch.setenv("PAGELLM_CPU_ISA", "" if request.param == "avx512" else request.param)
    kernels.use_avx2.cache_clear()
    kernels.use_avx512.cache_clear()
    if request.param != "scalar" and not kernels.use_avx2():
        pytest.skip("this CPU has no AVX2+FMA+F16C")
    if request.param == "avx512" and not kernels.use_avx512():
        pytest.skip("this CPU has no AVX-512F: its tiles run the AVX2 path, tested beside")
    yield request.param
    kernels.use_avx2.cache_clear()
    kernels.use_avx512.cache_clear()


def encode(weight: np.ndarray, qtype: QT) -> np.ndarray:
    """The matrix as the bytes GGUF would store, [rows, bytes per row]."""
    if qtype == QT.F32:
        stored = weight
    elif qtype == QT.F16:
        stored = weight.astype(np.float16)
    elif qtype == QT.BF16:
        stored = (weight.view(np.uint32) >> 16).astype(np.uint16)
    elif qtype in K_TYPES or qtype == QT.IQ4_NL:
        return random_blocks(weight.shape, qtype, np.random.default_rng(weight.shape[0]))
    else:
        stored = gguf.quants.quantize(weight, qtype)
    return np.ascontiguousarray(stored).view(np.uint8).reshape(weight.shape[0], -1)


def random_blocks(shape: tuple[int, int], qtype: QT, rng: np.random.Generator) -> np.ndarray:
    """A K-quant or IQ4 matrix of random bytes (every bit pattern is a valid block) with finite float16 scales: the
    gguf package dequantizes these types but cannot quantize them."""
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(shape[0] * shape[1] // block_elems, block_bytes), dtype=np.uint8)
    scale_offsets = {QT.Q2_K: [80, 82], QT.Q3_K: [108], QT.Q6_K: [208], QT.IQ4_NL: [0], QT.IQ4_XS: [0]}.get(
        qtype, [0, 2])  # d (and dmin)
    for offset in scale_offsets:
        blocks[:, offset:offset + 2] = rng.uniform(-0.02, 0.02, size=(len(blocks), 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(shape[0], -1)


def reference(x: np.ndarray, packed: np.ndarray, qtype: QT, columns: int) -> tuple[np.ndarray, np.ndarray]:
    dequantized = gguf.quants.dequantize(packed, qtype).reshape(packed.shape[0], columns).astype(np.float32)
    return x.astype(np.float64) @ dequantized.astype(np.float64).T, dequantized


def assert_matmul_close(got: np.ndarray, x: np.ndarray, dequantized: np.ndarray, want: np.ndarray) -> None:
    # float32 accumulation in another order: the error is bounded by the magnitude of the products summed.
    bound = 1e-5 * (np.abs(x).astype(np.float64) @ np.abs(dequantized).astype(np.float64).T) + 1e-6
    assert np.all(np.abs(got - want) <= bound), np.max(np.abs(got - want) / bound)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows,out_features,in_features", [(1, 37, 96), (2, 5, 32), (3, 64, 160), (4, 1, 64),
                                                             (5, 19, 96), (8, 12, 64), (17, 33, 128)])
def test_linear_matches_numpy(isa, qtype, rows, out_features, in_features):
    rng = np.random.default_rng(rows * 1000 + out_features)
    packed = encode(rng.standard_normal((out_features, in_features)).astype(np.float32), qtype)
    x = rng.standard_normal((rows, in_features)).astype(np.float32)
    want, dequantized = reference(x, packed, qtype, in_features)
    got = kernels.PackedMatmul(torch.from_numpy(packed), qtype, in_features)(torch.from_numpy(x)).numpy()
    assert got.shape == (rows, out_features)
    assert_matmul_close(got, x, dequantized, want)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_rows_is_exact(isa, qtype):
    """Bit-identical to ggml's definition: same float32 operations, same rounding."""
    rng = np.random.default_rng(7)
    weight = rng.standard_normal((23, 96)).astype(np.float32) * rng.uniform(0.01, 10, size=(23, 1)).astype(np.float32)
    packed = encode(weight, qtype)
    _, dequantized = reference(np.zeros((1, 96), np.float32), packed, qtype, 96)
    ids = torch.tensor([[5, 0], [22, 5]])
    matmul = kernels.PackedMatmul(torch.from_numpy(packed), qtype, 96)  # block types: rows interleaved by four
    got = matmul.dequantize_rows(ids)
    assert got.shape == (2, 2, 96)
    np.testing.assert_array_equal(got.numpy(), dequantized[ids.numpy()])
    np.testing.assert_array_equal(matmul.dequantize().numpy(), dequantized)


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows,out_features,in_features", [(1, 37, 256), (3, 5, 512), (4, 2, 256), (5, 19, 256),
                                                             (7, 4, 256), (17, 8, 512)])
def test_k_quants_match_numpy(isa, qtype, rows, out_features, in_features):
    rng = np.random.default_rng(rows)
    packed = encode(np.zeros((out_features, in_features), np.float32), qtype)
    x = rng.standard_normal((rows, in_features)).astype(np.float32)
    want, dequantized = reference(x, packed, qtype, in_features)
    matmul = kernels.PackedMatmul(torch.from_numpy(packed), qtype, in_features)
    assert_matmul_close(matmul(torch.from_numpy(x)).numpy(), x, dequantized, want)
    np.testing.assert_array_equal(matmul.dequantize().numpy(), dequantized)  # bit for bit, as ggml


@pytest.mark.parametrize("qtype", TYPES + K_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows,out_features", [(9, 61), (17, 6), (24, 25), (40, 1), (70, 50), (521, 7)])
def test_prefill_tiles_match_numpy(isa, threads, qtype, rows, out_features):
    """Prefill-sized batches (the tile path): activation blocks of 16 with 1-8 and 9-16 rows left over, panels of
    6 weight rows in groups of 4 with some left over, several column slices of 256 and a short last one, passes of
    256 activation rows with a short last one."""
    in_features = 768 if qtype in K_TYPES else 300 if qtype in (QT.F32, QT.F16, QT.BF16) else 288  # 300: not 8k
    rng = np.random.default_rng(rows * 100 + out_features)
    packed = encode(rng.standard_normal((out_features, in_features)).astype(np.float32), qtype)
    x = rng.standard_normal((rows, in_features)).astype(np.float32)
    want, dequantized = reference(x, packed, qtype, in_features)
    got = kernels.PackedMatmul(torch.from_numpy(packed), qtype, in_features)(torch.from_numpy(x)).numpy()
    assert_matmul_close(got, x, dequantized, want)


@pytest.mark.parametrize("qtype", TYPES + K_TYPES, ids=lambda t: t.name)
def test_avx512_tiles_compute_the_avx2_floats(threads, qtype):
    """The AVX-512 tiles run each output's chain of FMAs as the AVX2 ones do, only more outputs side by side: the
    same floats, so a CPU with AVX-512 gives the logprobs of one without. Blocks of 32 and 16 rows with rows left
    over, several passes."""
    kernels.use_avx512.cache_clear()
    if not kernels.use_avx512():
        pytest.skip("this CPU has no AVX-512F (or PAGELLM_CPU_ISA turns it off)")
    in_features = 768 if qtype in K_TYPES else 288
    rng = np.random.default_rng(7)
    packed = encode(rng.standard_normal((61, in_features)).astype(np.float32), qtype)
    matmul = kernels.PackedMatmul(torch.from_numpy(packed), qtype, in_features)
    for rows in (9, 17, 33, 70, 300):
        x = torch.from_numpy(rng.standard_normal((rows, in_features)).astype(np.float32))
        matmul._matrix.use_avx512 = 1
        wide = matmul(x)
        matmul._matrix.use_avx512 = 0
        assert torch.equal(wide, matmul(x)), f"{rows} rows"


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_avx512_small_batches_compute_the_avx2_floats(threads, qtype):
    """The exact small-M kernels' AVX-512 variant (1-8 activation rows, float32 activations: float types and the
    32-weight block types) runs the AVX2 kernels' chains of FMAs, two of their vectors per register: the same floats.
    Rows in groups of four and n % 4 = 1 and 3 left outside them, several widths, strided activations."""
    kernels.use_avx512.cache_clear()
    if not kernels.use_avx512():
        pytest.skip("this CPU has no AVX-512F (or PAGELLM_CPU_ISA turns it off)")
    rng = np.random.default_rng(11)
    for out_features, in_features in ((37, 96), (64, 288), (19, 1024)):
        packed = encode(rng.standard_normal((out_features, in_features)).astype(np.float32), qtype)
        matmul = kernels.PackedMatmul(torch.from_numpy(packed), qtype, in_features)
        wide_x = torch.from_numpy(rng.standard_normal((8, in_features + 32)).astype(np.float32))
        for rows in range(1, 9):
            x = wide_x[:rows, 16:16 + in_features]  # a row stride wider than the row
            matmul._matrix.use_avx512 = 1
            wide = matmul(x)
            matmul._matrix.use_avx512 = 0
            assert torch.equal(wide, matmul(x)), f"{rows} rows, {out_features} x {in_features}"


@pytest.mark.parametrize("qtype", [t for t in TYPES + K_TYPES if t not in (QT.F32, QT.F16, QT.BF16)],
                         ids=lambda t: t.name)
def test_each_small_batch_row_gets_the_floats_it_gets_alone(isa, qtype):
    """A speculative verify step multiplies 2-12 rows where plain decoding multiplies one; greedy output stays the
    same only if every row's floats do not depend on the rows beside it, up to the most rows the small-M path takes
    (12 of the 32-weight types, 8 of the super-block types; the AVX-512 group kernel takes 8 rows a pass, the others
    four). Groups of four weight rows with 3 left outside them."""
    super_blocks = qtype in K_TYPES
    in_features, most = (512, 8) if super_blocks else (288, 12)
    rng = np.random.default_rng(5)
    packed = encode(rng.standard_normal((43, in_features)).astype(np.float32), qtype)
    matmul = kernels.PackedMatmul(torch.from_numpy(packed), qtype, in_features)
    x = torch.from_numpy(rng.standard_normal((most, in_features)).astype(np.float32))
    alone = torch.cat([matmul(x[i:i + 1]) for i in range(most)])
    for rows in range(2, most + 1):
        assert torch.equal(matmul(x[:rows]), alone[:rows]), f"{rows} rows"


@pytest.mark.parametrize("rows", [1, 3, 9, 20])
def test_float32_odd_width_and_strided_activations(isa, rows):
    """Float32 rows of any width (no 32-wide blocks), and activations that are a column slice of a wider tensor."""
    rng = np.random.default_rng(rows)
    weight = rng.standard_normal((11, 45)).astype(np.float32)
    wide = torch.from_numpy(rng.standard_normal((rows, 60)).astype(np.float32))
    x = wide[:, :45]
    assert rows == 1 or not x.is_contiguous()  # (one row is contiguous whatever its stride)
    got = kernels.PackedMatmul(torch.from_numpy(weight).view(torch.uint8), QT.F32, 45)(x).numpy()
    assert_matmul_close(got, x.numpy(), weight, x.numpy().astype(np.float64) @ weight.astype(np.float64).T)


def test_quantized_types_extreme_scales(isa):
    """Subnormal, zero and large float16 scales decode like NumPy's float16."""
    rng = np.random.default_rng(3)
    packed = encode(rng.standard_normal((4, 64)).astype(np.float32), QT.Q4_1)
    blocks = packed.reshape(-1, 20).copy()
    scales = np.array([6e-8, 0.0, 6.0e4, -1.5e-5, 3.0, 1e-7, -2.0, 0.5], dtype=np.float16)
    blocks[:, 0:2] = scales.view(np.uint8).reshape(-1, 2)
    packed = blocks.reshape(4, -1)
    _, dequantized = reference(np.zeros((1, 64), np.float32), packed, QT.Q4_1, 64)
    np.testing.assert_array_equal(kernels.PackedMatmul(torch.from_numpy(packed), QT.Q4_1, 64).dequantize().numpy(),
                                  dequantized)


def test_row_width_must_be_whole_blocks():
    with pytest.raises(ValueError, match="multiple of 32"):
        kernels.row_bytes(QT.Q4_0, 48)
    assert kernels.row_bytes(QT.Q4_1, 576) == 18 * 20
