"""Tensor-parallel layers against F.linear / F.embedding on the whole matrices: two gloo ranks each load the full
checkpoint tensors (float32, or packed Q8_0 as a GGUF file stores them), keep their shard and compute; a
column-parallel rank's output is its slice of the full output, row-parallel outputs, embeddings and logits are
the full ones on every rank. Head assignment for larger sizes and the slicing of packed rows are checked in one
process."""
from __future__ import annotations

from types import SimpleNamespace

import gguf
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QT
from rank_launcher import run_ranks

from pagellm.config import ModelConfig
from pagellm.distributed.parallel_state import GroupCoordinator
from pagellm.model_executor.layers import linear as linear_module
from pagellm.model_executor.layers.linear import (
    KERNEL_MAX_ROWS,
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagellm.model_executor.layers.quantization import PackedTensor, quantize_q8_0
from pagellm.model_executor.layers.sharding import narrow_columns, narrow_rows
from pagellm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

TP = 2
HEAD = 8
STORAGES = ("float32", "q8_0")


def _tensors() -> dict[str, torch.Tensor]:
    """The same checkpoint tensors and inputs in every process."""
    generator = torch.Generator().manual_seed(0)
    shapes = dict(column=(48, 64), column_bias=(48,), gate=(32, 64), up=(32, 64), q=(4 * HEAD, 64),
                  k=(2 * HEAD, 64), v=(2 * HEAD, 64), k1=(HEAD, 64), v1=(HEAD, 64), q_bias=(4 * HEAD,),
                  k_bias=(2 * HEAD,), v_bias=(2 * HEAD,), row=(40, 64), row_bias=(40,), row_unaligned=(40, 96),
                  vocab=(51, 64), x=(3, 64), x_long=(KERNEL_MAX_ROWS + 5, 64), x_unaligned=(3, 96))
    tensors = {name: torch.randn(*shape, generator=generator) for name, shape in shapes.items()}
    tensors["ids"] = torch.tensor([0, 25, 26, 50, 7, 33])
    return tensors


def _stored(tensor: torch.Tensor, storage: str, qtype: QT = QT.Q8_0) -> torch.Tensor | PackedTensor:
    """A checkpoint matrix as the loader hands it over: float, or packed blocks."""
    if storage == "float32":
        return tensor
    if qtype == QT.Q8_0:
        return quantize_q8_0(tensor)
    blocks = gguf.quants.quantize(tensor.numpy(), qtype).reshape(tensor.shape[0], -1)
    return PackedTensor(qtype, torch.from_numpy(blocks), tuple(tensor.shape))


def _full(tensor: torch.Tensor, storage: str, qtype: QT = QT.Q8_0) -> torch.Tensor:
    """The matrix a layer should compute with: the dequantized blocks when packed."""
    stored = _stored(tensor, storage, qtype)
    return stored.dequantize() if isinstance(stored, PackedTensor) else stored


def _rank_outputs() -> dict:
    """Every parallel layer's output on this rank, for each storage."""
    t = _tensors()
    out = {}
    for storage in STORAGES:
        column = ColumnParallelLinear(64, 48, bias=True)
        column.load_weight(_stored(t["column"], storage), "gguf")
        column.load_bias_shard(t["column_bias"], 0)
        merged = MergedColumnParallelLinear(64, [32, 32])
        merged.load_shard(_stored(t["up"], storage), 1, "gguf")
        merged.load_shard(_stored(t["gate"], storage), 0, "gguf")
        qkv = {}
        for kv_heads, (k, v) in {2: ("k", "v"), 1: ("k1", "v1")}.items():
            layer = qkv[kv_heads] = QKVParallelLinear(64, HEAD, 4, kv_heads, bias=kv_heads == 2)
            for shard, name in enumerate(("q", k, v)):
                layer.load_shard(_stored(t[name], storage), shard, "gguf")
                if layer.bias is not None:
                    layer.load_bias_shard(t[f"{name}_bias"], shard)
        rank = column.tp.rank
        row = RowParallelLinear(64, 40, bias=True)
        row.load_weight(_stored(t["row"], storage), "gguf")
        row.bias.data.copy_(t["row_bias"])  # replicated: the loader copies it whole
        unaligned = RowParallelLinear(96, 40)  # 48 columns per rank: Q4_0 blocks (32) would straddle the ranks
        unaligned.load_weight(_stored(t["row_unaligned"], storage, QT.Q4_0), "gguf")
        embedding = VocabParallelEmbedding(51, 64)
        embedding.load_weight(_stored(t["vocab"], storage), "gguf")
        head = ParallelLMHead(51, 64)
        head.load_weight(_stored(t["vocab"], storage), "gguf")
        out[storage] = dict(
            column=[column(t[x]) for x in ("x", "x_long")], merged=[merged(t[x]) for x in ("x", "x_long")],
            qkv={kv: (layer(t["x"]), layer.num_heads, layer.num_kv_heads) for kv, layer in qkv.items()},
            row=[row(t[x][:, rank * 32:(rank + 1) * 32]) for x in ("x", "x_long")],
            unaligned=unaligned(t["x_unaligned"][:, rank * 48:(rank + 1) * 48]),
            embedding=embedding(t["ids"]), tied_logits=embedding.compute_logits(t["x"]), head_logits=head(t["x"]),
            packed={name: layer.packed_types for name, layer in
                    dict(column=column, merged=merged, row=row, unaligned=unaligned, embedding=embedding).items()})
    return out


@pytest.fixture(scope="module")
def rank_outputs(tmp_path_factory) -> list[dict]:
    return run_ranks(_rank_outputs, tmp_path_factory.mktemp("tp-layers"), TP)


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.double(), expected.double(), rtol=1e-4, atol=1e-4)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x.double(), weight.double(), None if bias is None else bias.double())


@pytest.mark.parametrize("storage", STORAGES)
def test_column_parallel_outputs_are_slices_of_the_full_output(rank_outputs, storage):
    t = _tensors()
    for rank, outputs in enumerate(rank_outputs):
        out = outputs[storage]
        cols = slice(rank * 24, (rank + 1) * 24)
        for got, x in zip(out["column"], ("x", "x_long")):
            assert_close(got, _linear(t[x], _full(t["column"], storage), t["column_bias"])[:, cols])
        half = slice(rank * 16, (rank + 1) * 16)
        for got, x in zip(out["merged"], ("x", "x_long")):
            gate, up = (_linear(t[x], _full(t[name], storage)) for name in ("gate", "up"))
            assert_close(got, torch.cat([gate[:, half], up[:, half]], dim=1))
        assert out["packed"]["column"] == out["packed"]["merged"] == ((QT.Q8_0,) if storage == "q8_0" else ())


@pytest.mark.parametrize("storage", STORAGES)
def test_qkv_parallel_splits_heads_and_replicates_scarce_kv_heads(rank_outputs, storage):
    t = _tensors()
    for rank, outputs in enumerate(rank_outputs):
        for kv_heads, (k, v) in {2: ("k", "v"), 1: ("k1", "v1")}.items():
            got, num_heads, num_kv_heads = outputs[storage]["qkv"][kv_heads]
            assert (num_heads, num_kv_heads) == (2, 1)
            bias = kv_heads == 2
            q_full, k_full, v_full = (_linear(t["x"], _full(t[name], storage), t[f"{name}_bias"] if bias else None)
                                      for name in ("q", k, v))
            kv_head = rank if kv_heads == 2 else 0  # one KV head: both ranks' query heads use it
            kv_cols = slice(kv_head * HEAD, (kv_head + 1) * HEAD)
            assert_close(got, torch.cat([q_full[:, rank * 2 * HEAD:(rank + 1) * 2 * HEAD], k_full[:, kv_cols],
                                         v_full[:, kv_cols]], dim=1))


@pytest.mark.parametrize("storage", STORAGES)
def test_row_parallel_sums_to_the_full_output(rank_outputs, storage):
    t = _tensors()
    for outputs in rank_outputs:
        out = outputs[storage]
        for got, x in zip(out["row"], ("x", "x_long")):
            assert_close(got, _linear(t[x], _full(t["row"], storage), t["row_bias"]))
        assert_close(out["unaligned"], _linear(t["x_unaligned"], _full(t["row_unaligned"], storage, QT.Q4_0)))
        assert out["packed"]["row"] == ((QT.Q8_0,) if storage == "q8_0" else ())
        assert out["packed"]["unaligned"] == ()  # dequantized: the split falls inside Q4_0 blocks


@pytest.mark.parametrize("storage", STORAGES)
def test_vocab_parallel_embedding_and_lm_head(rank_outputs, storage):
    t = _tensors()
    vocab = _full(t["vocab"], storage)
    for outputs in rank_outputs:
        out = outputs[storage]
        # 51 rows: rank 0 holds 26, rank 1 holds 25 (its logits are padded for the gather, then cut).
        assert torch.equal(out["embedding"], F.embedding(t["ids"], vocab))
        assert out["tied_logits"].shape == (3, 51)
        assert_close(out["tied_logits"], _linear(t["x"], vocab))
        assert_close(out["head_logits"], _linear(t["x"], vocab))
        assert out["packed"]["embedding"] == ((QT.Q8_0,) if storage == "q8_0" else ())


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("kv_heads", [1, 2, 4, 8])
def test_each_rank_gets_the_kv_heads_its_query_heads_use(tp, kv_heads, monkeypatch):
    heads = 8
    config = ModelConfig(model="", tokenizer="", hf_config=SimpleNamespace(num_attention_heads=heads,
                                                                            num_key_value_heads=kv_heads),
                         architecture="", dtype=torch.float32, max_model_len=1, max_logprobs=0)
    for rank in range(tp):
        group = GroupCoordinator(rank, tp, list(range(tp)))
        monkeypatch.setattr(linear_module, "get_tp_group", lambda group=group: group)
        layer = QKVParallelLinear(16, HEAD, heads, kv_heads)
        q, k, v = layer.output_shards
        assert layer.num_kv_heads == config.get_num_kv_heads(tp)
        assert (q.start, q.size) == (rank * heads // tp * HEAD, heads // tp * HEAD)
        query_heads = range(q.start // HEAD, (q.start + q.size) // HEAD)
        kv_of_query = {h // (heads // kv_heads) for h in query_heads}
        assert set(range(k.start // HEAD, (k.start + k.size) // HEAD)) == kv_of_query and k == v


def test_sizes_that_do_not_divide_are_refused(monkeypatch):
    monkeypatch.setattr(linear_module, "get_tp_group", lambda: GroupCoordinator(0, 4, [0, 1, 2, 3]))
    with pytest.raises(ValueError, match="number of attention heads"):
        QKVParallelLinear(16, HEAD, 6, 2)
    with pytest.raises(ValueError, match="multiple of the number of KV heads"):
        QKVParallelLinear(16, HEAD, 12, 3)
    with pytest.raises(ValueError, match=r"input size \(50\)"):
        RowParallelLinear(50, 8)


def test_packed_slices():
    matrix = torch.randn(6, 128)
    packed = quantize_q8_0(matrix)
    assert narrow_rows(packed, 0, 6) is packed and narrow_columns(packed, 0, 128) is packed  # one rank: as is
    rows = narrow_rows(packed, 2, 3)
    assert torch.equal(rows.dequantize(), packed.dequantize()[2:5])
    columns = narrow_columns(packed, 64, 32)  # on block boundaries: stays packed, copied out of the file buffer
    assert isinstance(columns, PackedTensor) and columns.shape == (6, 32)
    assert columns.data.is_contiguous() and columns.data.untyped_storage() is not packed.data.untyped_storage()
    assert torch.equal(columns.dequantize(), packed.dequantize()[:, 64:96])
    straddling = narrow_columns(packed, 48, 32)  # inside blocks: float32 columns
    assert isinstance(straddling, torch.Tensor) and torch.equal(straddling, packed.dequantize()[:, 48:80])
