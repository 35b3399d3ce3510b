"""Linear layers with packed and float weights: what gets packed, and that every path (the C kernel at decode
sizes, dequantize-then-GEMM for long inputs, the float32 GEMV kernel) equals F.linear on the dequantized matrix."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from pagellm.model_executor.layers import linear as linear_module
from pagellm.model_executor.layers.linear import Linear, MergedColumnParallelLinear
from pagellm.model_executor.layers.quantization import PackedTensor, quantize_q8_0
from pagellm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding


def packed(rows: int, columns: int, qtype: QT, seed: int = 0) -> PackedTensor:
    weight = np.random.default_rng(seed).standard_normal((rows, columns)).astype(np.float32)
    blocks = gguf.quants.quantize(weight, qtype).view(np.uint8).reshape(rows, -1)
    return PackedTensor(qtype, torch.from_numpy(blocks.copy()), (rows, columns))


@pytest.mark.parametrize("num_rows", [1, 4, linear_module.KERNEL_MAX_ROWS + 1])
def test_packed_linear_equals_float_linear(num_rows):
    weight = packed(48, 96, QT.Q4_1)
    layer = Linear(96, 48, bias=True)
    layer.bias.data.normal_()
    layer.load_weight(weight, "gguf")
    assert layer.packed_types == (QT.Q4_1,) and "weight" not in dict(layer.named_parameters())
    x = torch.randn(num_rows, 96)
    want = torch.nn.functional.linear(x.double(), weight.dequantize().double(), layer.bias.double())
    torch.testing.assert_close(layer(x).double(), want, rtol=1e-5, atol=1e-5)


def test_quantization_none_dequantizes_and_unsupported_types_fall_back():
    layer = Linear(96, 48)
    layer.load_weight(packed(48, 96, QT.Q8_0), "none")
    assert not layer.packed_types
    torch.testing.assert_close(layer.weight.data, packed(48, 96, QT.Q8_0).dequantize(), rtol=0, atol=0)

    rng = np.random.default_rng(2)
    iq2_xxs = PackedTensor(QT.IQ2_XXS, torch.from_numpy(rng.integers(0, 256, (4, 66), dtype=np.uint8)), (4, 256))
    iq2_xxs.data[:, 0:2] = torch.from_numpy(np.full((4, 1), 0.01, np.float16).view(np.uint8))  # finite scales
    layer = Linear(256, 4)
    layer.load_weight(iq2_xxs, "gguf")  # no kernel for the other IQ types: float32, exactly dequantized
    assert not layer.packed_types and torch.equal(layer.weight.data, iq2_xxs.dequantize())


def test_k_quants_stay_packed():
    rng = np.random.default_rng(5)
    blocks = rng.integers(0, 256, size=(6 * 2, 210), dtype=np.uint8)
    blocks[:, 208:210] = np.full((len(blocks), 1), 0.01, np.float16).view(np.uint8)  # finite scales
    q6_k = PackedTensor(QT.Q6_K, torch.from_numpy(blocks.reshape(6, -1)), (6, 512))
    layer = Linear(512, 6)
    layer.load_weight(q6_k, "gguf")
    assert layer.packed_types == (QT.Q6_K,)
    x = torch.randn(2, 512)
    torch.testing.assert_close(layer(x).double(), x.double() @ q6_k.dequantize().double().T, rtol=1e-5, atol=1e-5)


def test_float32_small_batch_kernel_matches_torch():
    layer = Linear(64, 40)
    layer.load_weight(torch.randn(40, 64), "none")
    for rows in (1, 2, 4, 9):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight), rtol=1e-5, atol=1e-5)


def test_merged_linear_packs_when_all_shards_share_a_type():
    layer = MergedColumnParallelLinear(64, [32, 16, 16])
    shards = [packed(32, 64, QT.Q4_0, 1), packed(16, 64, QT.Q4_0, 2), packed(16, 64, QT.Q4_0, 3)]
    for index in (2, 0, 1):  # any order
        layer.load_shard(shards[index], index, "gguf")
    assert layer.packed_types == (QT.Q4_0,) and not layer.has_pending_shards
    x = torch.randn(3, 64)
    want = torch.cat([x @ s.dequantize().T for s in shards], dim=1)
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_rows", [1, 3, linear_module.KERNEL_MAX_ROWS + 1])
def test_merged_linear_stacks_shards_of_different_types(num_rows):
    """A Q8_0 part beside a Q4_0 one (as llama.cpp's K_M mixes write v_proj or ffn parts): each stays packed in its
    own type and one kernel call computes both; prefill-sized inputs use the stack dequantized."""
    shards = [packed(32, 64, QT.Q4_0, 1), packed(16, 64, QT.Q8_0, 2)]
    mixed = MergedColumnParallelLinear(64, [32, 16])
    mixed.load_shard(shards[0], 0, "gguf")
    assert mixed.has_pending_shards
    mixed.load_shard(shards[1], 1, "gguf")
    assert mixed.packed_types == (QT.Q4_0, QT.Q8_0) and "weight" not in dict(mixed.named_parameters())
    x = torch.randn(num_rows, 64)
    want = torch.cat([x @ s.dequantize().T for s in shards], dim=1)
    torch.testing.assert_close(mixed(x), want, rtol=1e-5, atol=1e-5)

    float_beside_packed = MergedColumnParallelLinear(64, [32, 16])
    float_beside_packed.load_shard(shards[0], 0, "gguf")
    float_beside_packed.load_shard(torch.randn(16, 64), 1, "gguf")
    assert not float_beside_packed.packed_types  # one float matrix
    torch.testing.assert_close(float_beside_packed.weight.data[:32], shards[0].dequantize(), rtol=0, atol=0)


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="expected"):
        Linear(64, 8).load_weight(packed(16, 64, QT.Q8_0), "gguf")
    with pytest.raises(ValueError, match="shard 1 has 8 rows, expected 16"):
        MergedColumnParallelLinear(64, [32, 16]).load_shard(packed(8, 64, QT.Q8_0), 1, "gguf")


def test_vocab_embedding_lookup_and_tied_head():
    weight = packed(50, 64, QT.Q8_0)
    embedding = VocabParallelEmbedding(50, 64)
    embedding.load_weight(weight, "gguf")
    ids = torch.tensor([3, 0, 49, 3])
    assert torch.equal(embedding(ids), weight.dequantize()[ids])
    hidden = torch.randn(2, 64)
    torch.testing.assert_close(embedding.matmul(hidden), hidden @ weight.dequantize().T, rtol=1e-5, atol=1e-5)


def test_int8_quantization_of_float_weights():
    """Q8_0 blocks: every weight within half a quantization step of the original (plus the scale's float16 rounding)."""
    weight = torch.randn(24, 96)
    layer = Linear(96, 24)
    layer.load_weight(weight, "int8")
    assert layer.packed_types == (QT.Q8_0,)
    step = weight.abs().reshape(24, 3, 32).amax(dim=-1, keepdim=True) / 127
    error = (quantize_q8_0(weight).dequantize() - weight).abs().reshape(24, 3, 32)
    assert torch.all(error <= step * (0.5 + 127 / 2048))  # half a step, plus the float16 rounding of the scale
    odd = Linear(45, 8)  # rows that are not whole blocks stay float
    odd.load_weight(torch.randn(8, 45), "int8")
    assert not odd.packed_types
