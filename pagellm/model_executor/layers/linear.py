"""Linear layers whose weight is a float matrix or packed GGUF blocks, and the vocabulary embedding that shares
their storage (a tied LM head multiplies with it like any linear layer).

Fusing q/k/v and gate/up into one matmul each halves the number of kernel launches per layer; a fused layer is
loaded shard by shard and stored once all its shards are in. A packed weight (`qweight`: uint8 rows of ggml
blocks of type `qweight_type`) is multiplied by the C kernel (`kernels.linear`), which dequantizes in registers,
for up to KERNEL_MAX_ROWS activation rows; longer inputs (prefill) dequantize it into a float32 matrix for
PyTorch's GEMM, where the arithmetic dwarfs the conversion. Float32 weights on the CPU also go through the kernel
for up to KERNEL_MAX_ROWS rows: PyTorch's GEMV runs far below the memory bandwidth, and at decode batch sizes
its GEMM trails the kernel too (measured: 132 vs 73 ms for SmolLM2's layers at 32 rows).
"""
from __future__ import annotations

import torch
from torch import nn

from pagellm.kernels import linear as kernels
from pagellm.logger import init_logger
from pagellm.model_executor.layers.quantization import PackedTensor, quantize_q8_0

logger = init_logger(__name__)

KERNEL_MAX_ROWS = 64  # measured: above this PyTorch's float32 GEMM (after dequantizing packed weights) wins


def _kernel_can_pack(qtype: int, like: torch.Tensor) -> bool:
    return (like.device.type == "cpu" and like.dtype == torch.float32 and qtype in kernels.SUPPORTED_TYPES
            and kernels.available())


class Linear(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None
        self.qweight_type: int | None = None  # set when the weight is packed (then `qweight` replaces `weight`)
        # The C kernel bound to this weight once loaded (packed, or float32 on the CPU); the fused decoder uses it too.
        self.kernel: kernels.PackedMatmul | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x)
        return out if self.bias is None else out + self.bias

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T, without the bias."""
        if self.kernel is not None:
            rows = x.numel() // self.input_size
            if self.qweight_type is not None:
                if rows <= KERNEL_MAX_ROWS:
                    return self.kernel(x)
                return nn.functional.linear(x, kernels.dequantize(self.qweight, self.qweight_type, self.input_size))
            if rows <= KERNEL_MAX_ROWS and x.dtype == torch.float32:
                return self.kernel(x)
        return nn.functional.linear(x, self.weight)

    def load_weight(self, loaded: torch.Tensor | PackedTensor, quantization: str) -> None:
        """Store a checkpoint matrix: packed when `quantization` allows and the kernel handles its type, else as
        float in the parameter's dtype."""
        if tuple(loaded.shape) != (self.output_size, self.input_size):
            raise ValueError(f"Checkpoint matrix has shape {tuple(loaded.shape)}, expected "
                             f"{(self.output_size, self.input_size)}.")
        packed = loaded if isinstance(loaded, PackedTensor) else None
        if packed is None and quantization == "int8" and self.input_size % 32 == 0:
            packed = quantize_q8_0(loaded)
        if packed is not None and quantization != "none" and _kernel_can_pack(packed.qtype, self.weight):
            del self.weight
            self.register_buffer("qweight", packed.data.contiguous(), persistent=False)
            self.qweight_type = int(packed.qtype)
            self.kernel = kernels.PackedMatmul(self.qweight, self.qweight_type, self.input_size)
            return
        self.weight.data.copy_(packed.dequantize() if packed is not None else loaded)
        if _kernel_can_pack(kernels.T.F32, self.weight) and self.input_size % 32 == 0:
            self.kernel = kernels.PackedMatmul(self.weight.data.view(torch.uint8), kernels.T.F32, self.input_size)


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dimension (q|k|v, gate|up)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__(input_size, sum(output_sizes), bias)
        self.output_sizes = output_sizes
        self.offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes))]
        self._shards: dict[int, torch.Tensor | PackedTensor] = {}

    @property
    def has_pending_shards(self) -> bool:
        return bool(self._shards)

    def load_shard(self, loaded: torch.Tensor | PackedTensor, shard: int, quantization: str) -> None:
        """Keep shard `shard` until every shard is in, then store the stacked matrix (packed when all shards share
        one storage type)."""
        if loaded.shape[0] != self.output_sizes[shard]:
            raise ValueError(f"Checkpoint shard {shard} has {loaded.shape[0]} rows, expected "
                             f"{self.output_sizes[shard]}.")
        self._shards[shard] = loaded
        if len(self._shards) < len(self.output_sizes):
            return
        shards = [self._shards.pop(i) for i in range(len(self.output_sizes))]
        types = {s.qtype if isinstance(s, PackedTensor) else None for s in shards}
        if len(types) == 1 and None not in types:
            stacked = PackedTensor(shards[0].qtype, torch.cat([s.data for s in shards]),
                                   (self.output_size, self.input_size))
        else:  # mixed storage (e.g. a Q6_K v_proj beside Q4_K q/k): one float matrix
            stacked = torch.cat([s.dequantize() if isinstance(s, PackedTensor) else s for s in shards])
        self.load_weight(stacked, quantization)

    def load_bias_shard(self, loaded: torch.Tensor, shard: int) -> None:
        start, size = self.offsets[shard], self.output_sizes[shard]
        if loaded.shape[0] != size:
            raise ValueError(f"Checkpoint shard {shard} has {loaded.shape[0]} rows, expected {size}.")
        self.bias.data[start:start + size].copy_(loaded)


class VocabEmbedding(Linear):
    """Token embeddings [vocab, hidden]; `matmul` is the tied LM head."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__(hidden_size, vocab_size)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.qweight_type is not None:
            return kernels.dequantize_rows(self.qweight, self.qweight_type, token_ids, self.input_size)
        return nn.functional.embedding(token_ids, self.weight)
