"""Linear layers whose weight is a float matrix or packed GGUF blocks, whole on every rank (`Linear`) or split
across the tensor-parallel ranks (vLLM's layouts, Megatron's split: column-parallel layers feed row-parallel ones
with no communication between them, and each row-parallel output is summed over the ranks once).

Fusing q/k/v and gate/up into one matmul each halves the number of kernel launches per layer; a fused layer is
loaded shard by shard and stored once all its shards are in. A packed weight (`qweight`: ggml blocks of type
`packed_types`, in the kernel's interleaved layout; a fused layer whose parts the file stores in different types
keeps one `qweight_i` per part) is multiplied by the C kernel (`kernels.linear`) at every length: it dequantizes
in registers for a few rows, and for prefill a slice at a time that stays in cache (measured 1.1-2.4x faster
than dequantizing the whole matrix for PyTorch's GEMM on TinyLlama's shapes at 65-512 rows, even on SmolLM2's
up to 128). Float32 weights on the CPU also go through the kernel for up to KERNEL_MAX_ROWS rows: PyTorch's GEMV
runs far below the memory bandwidth, and at decode batch sizes its GEMM trails the kernel too (measured: 132 vs
73 ms for SmolLM2's layers at 32 rows).

Sizes given to the parallel layers are the checkpoint's (whole model); `input_size` / `output_size` on every
layer are this rank's. With one rank every split is the whole matrix and nothing is communicated.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagellm.distributed.parallel_state import GroupCoordinator, get_tp_group
from pagellm.kernels import linear as kernels
from pagellm.lora import context as lora_context
from pagellm.model_executor.layers.quantization import PackedTensor, quantize_q8_0
from pagellm.model_executor.layers.sharding import Weight, check_shape, divide, narrow_columns, narrow_rows

KERNEL_MAX_ROWS = 64  # float32 weights: above this PyTorch's GEMM on the matrix itself


def _kernel_can_pack(qtype: int, like: torch.Tensor) -> bool:
    return (like.device.type == "cpu" and like.dtype == torch.float32 and qtype in kernels.SUPPORTED_TYPES
            and kernels.available())


class Linear(nn.Module):
    """y = x W^T + b with the whole matrix on this rank: the storage and matmul every layer here shares."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None
        # Storage types of the packed matrix, one per stacked part (a fused q|k|v may hold v in another type); empty
        # when the weight is float. Packed parts replace `weight` with `qweight` buffers in the kernel's layout.
        self.packed_types: tuple[int, ...] = ()
        # The C kernel bound to this weight once loaded (packed, or float32 on the CPU); the fused decoder uses it too.
        self.kernel: kernels.PackedMatmul | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul_lora(x)
        return out if self.bias is None else out + self.bias

    def matmul_lora(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T plus, for rows that run with a LoRA adapter, its delta (see lora/context.py)."""
        out = self.matmul(x)
        lora = lora_context.current()
        return out if lora is None else lora.add_deltas(self, x, out)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T, without the bias."""
        if self.kernel is not None:
            if x.dtype == torch.float32 and (self.packed_types or x.numel() // self.input_size <= KERNEL_MAX_ROWS):
                return self.kernel(x)
            if self.packed_types:
                return nn.functional.linear(x, self.kernel.dequantize())
        return nn.functional.linear(x, self.weight)

    def load_weight(self, loaded: Weight, quantization: str) -> None:
        """Store a checkpoint matrix: packed when `quantization` allows and the kernel handles its type, else as
        float in the parameter's dtype."""
        check_shape(loaded, (self.output_size, self.input_size))
        self._store(loaded, quantization)

    def _store(self, loaded: Weight | list[PackedTensor], quantization: str) -> None:
        """Keep this rank's matrix [output_size, input_size]; a list is packed parts of different storage types,
        stacked along the output."""
        parts = loaded if isinstance(loaded, list) else [loaded]
        if quantization == "int8" and isinstance(loaded, torch.Tensor) and self.input_size % 32 == 0:
            parts = [quantize_q8_0(loaded)]
        if quantization != "none" and all(isinstance(p, PackedTensor) and _kernel_can_pack(p.qtype, self.weight)
                                          for p in parts):
            del self.weight
            matmuls = [kernels.PackedMatmul(p.data, p.qtype, self.input_size) for p in parts]
            for i, matmul in enumerate(matmuls):  # the weights in the kernel's layout
                self.register_buffer("qweight" if len(parts) == 1 else f"qweight_{i}", matmul.weight,
                                     persistent=False)
            self.kernel = matmuls[0] if len(parts) == 1 else kernels.PackedMatmul.stack(matmuls)
            self.packed_types = tuple(int(p.qtype) for p in parts)
            return
        if not isinstance(loaded, torch.Tensor):
            loaded = torch.cat([p.dequantize() for p in parts])
        self.weight.data.copy_(loaded)
        if _kernel_can_pack(kernels.T.F32, self.weight) and self.input_size % 32 == 0:
            self.kernel = kernels.PackedMatmul(self.weight.data.view(torch.uint8), kernels.T.F32, self.input_size)


def quantize_activations(model: nn.Module) -> int:
    """Give every packed layer of `model` int8 activations (`--quantize-activations`: llama.cpp's arithmetic,
    kernels/linear_int8.inc): K-quant layers in every matmul, prefill included, 32-weight types in matmuls of up to 48
    rows; returns how many layers changed."""
    layers = [m for m in model.modules() if isinstance(m, Linear) and m.packed_types]
    for layer in layers:
        layer.kernel.int8_activations = True
    return len(layers)


@dataclass(frozen=True, slots=True)
class OutputShard:
    """Rows [start, start + size) of a projection with `total` rows in the checkpoint: what this rank computes."""
    total: int
    start: int
    size: int


class ColumnParallelLinear(Linear):
    """Output features split across the ranks: each rank computes its slice of y, which stays split (the next
    row-parallel layer takes it as its input slice). The layer may stack several projections of the same input
    (`output_sizes`), each split on its own so every rank holds a slice of each; `output_sizes` and `offsets`
    are then this rank's rows per projection."""

    def __init__(self, input_size: int, output_size: int | list[int], bias: bool = False) -> None:
        self.tp: GroupCoordinator = get_tp_group()
        totals = [output_size] if isinstance(output_size, int) else list(output_size)
        self.output_shards = self._shard_outputs(totals)
        super().__init__(input_size, sum(s.size for s in self.output_shards), bias)
        self.output_sizes = [s.size for s in self.output_shards]
        self.offsets = [sum(self.output_sizes[:i]) for i in range(len(self.output_sizes))]
        self._shards: dict[int, Weight] = {}

    def _shard_outputs(self, totals: list[int]) -> list[OutputShard]:
        """Which rows of each projection this rank keeps: an even split."""
        shards = []
        for total in totals:
            size = divide(total, self.tp.world_size, "output size")
            shards.append(OutputShard(total, self.tp.rank * size, size))
        return shards

    @property
    def has_pending_shards(self) -> bool:
        return bool(self._shards)

    def load_weight(self, loaded: Weight, quantization: str) -> None:
        """The checkpoint's matrix with every projection of this layer stacked."""
        check_shape(loaded, (sum(s.total for s in self.output_shards), self.input_size))
        start = 0
        for index, shard in enumerate(self.output_shards):
            self.load_shard(narrow_rows(loaded, start, shard.total), index, quantization)
            start += shard.total

    def load_shard(self, loaded: Weight, shard: int, quantization: str) -> None:
        """Keep this rank's rows of projection `shard` until every projection is in, then store the stacked
        matrix (packed when all share one storage type)."""
        if loaded.shape[0] != self.output_shards[shard].total:
            raise ValueError(f"Checkpoint shard {shard} has {loaded.shape[0]} rows, expected "
                             f"{self.output_shards[shard].total}.")
        check_shape(loaded, (loaded.shape[0], self.input_size))
        self._shards[shard] = narrow_rows(loaded, self.output_shards[shard].start, self.output_shards[shard].size)
        if len(self._shards) < len(self.output_shards):
            return
        shards = [self._shards.pop(i) for i in range(len(self.output_shards))]
        types = {s.qtype if isinstance(s, PackedTensor) else None for s in shards}
        if len(shards) == 1:
            stacked = shards[0]
        elif len(types) == 1 and None not in types:
            stacked = PackedTensor(shards[0].qtype, torch.cat([s.data for s in shards]),
                                   (self.output_size, self.input_size))
        elif None not in types:  # packed in different types (a Q6_K v_proj beside Q4_K q/k): a stack of parts
            stacked = shards
        else:  # float beside packed: one float matrix
            stacked = torch.cat([s.dequantize() if isinstance(s, PackedTensor) else s for s in shards])
        self._store(stacked, quantization)

    def load_bias_shard(self, loaded: torch.Tensor, shard: int) -> None:
        """This rank's part of projection `shard`'s bias (`shard` 0 of a single projection: the whole bias)."""
        rows = self.output_shards[shard]
        if loaded.shape[0] != rows.total:
            raise ValueError(f"Checkpoint shard {shard} has {loaded.shape[0]} rows, expected {rows.total}.")
        start = self.offsets[shard]
        self.bias.data[start:start + rows.size].copy_(narrow_rows(loaded, rows.start, rows.size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several projections of the same input stacked along the output dimension (gate|up), each split across
    the ranks on its own."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__(input_size, output_sizes, bias)


class QKVParallelLinear(ColumnParallelLinear):
    """q|k|v split by heads: each rank computes total_num_heads / tp query heads and the KV heads they attend
    with. With fewer KV heads than ranks the KV heads are replicated: each rank keeps the one KV head its query
    heads use (num_kv_heads is then 1)."""

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool = False) -> None:
        self.head_size, self.total_num_heads, self.total_num_kv_heads = head_size, total_num_heads, total_num_kv_heads
        q_size, kv_size = total_num_heads * head_size, total_num_kv_heads * head_size
        super().__init__(hidden_size, [q_size, kv_size, kv_size], bias)
        # This rank's heads: what attention and the KV cache are sized by.
        self.num_heads = self.output_sizes[0] // head_size
        self.num_kv_heads = self.output_sizes[1] // head_size

    def _shard_outputs(self, totals: list[int]) -> list[OutputShard]:
        tp, rank = self.tp.world_size, self.tp.rank
        heads = divide(self.total_num_heads, tp, "number of attention heads")
        if self.total_num_kv_heads >= tp:
            kv_heads = divide(self.total_num_kv_heads, tp, "number of KV heads")
        elif tp % self.total_num_kv_heads:
            raise ValueError(f"The tensor parallel size ({tp}) must be a multiple of the number of KV heads "
                             f"({self.total_num_kv_heads}) when it is larger.")
        else:
            kv_heads = 1
        # Query head h attends with KV head h // (heads per KV head), so this rank's first query head
        # (rank * heads) picks KV head rank * total_kv // tp; when replicated, tp / total_kv ranks share it.
        kv_start = rank * self.total_num_kv_heads // tp
        q = OutputShard(totals[0], rank * heads * self.head_size, heads * self.head_size)
        kv = OutputShard(totals[1], kv_start * self.head_size, kv_heads * self.head_size)
        return [q, kv, kv]


class RowParallelLinear(Linear):
    """Input features split across the ranks: each rank multiplies its slice of x (the previous column-parallel
    layer's output) by its columns of W, and the partial products are summed over the ranks; the bias is added
    once, after the sum."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        self.tp: GroupCoordinator = get_tp_group()
        super().__init__(divide(input_size, self.tp.world_size, "input size"), output_size, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(self.matmul_lora(x))
        return out if self.bias is None else out + self.bias

    def load_weight(self, loaded: Weight, quantization: str) -> None:
        check_shape(loaded, (self.output_size, self.input_size * self.tp.world_size))
        self._store(narrow_columns(loaded, self.tp.rank * self.input_size, self.input_size), quantization)
