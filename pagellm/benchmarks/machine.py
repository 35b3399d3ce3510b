"""The machine's own limits, for benchmark ratios: measured matmul peak and memory bandwidth, and the useful FLOPs of a
workload; and the line that says which machine a benchmark's figures come from."""
from __future__ import annotations

import time

import torch

from pagellm.kernels import build


def machine_header() -> str:
    """Where a benchmark's figures were measured, printed before them: the CPU's model name (lscpu's), PyTorch's
    threads, the instruction sets pagellm's C kernels use there, and the GPU if there is one. The same run gives
    other figures on another kind of machine (an AMD EPYC, an Intel Xeon), so each says which it had."""
    gpu = f"; GPU: {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return f"CPU: {build.cpu_model()}, {torch.get_num_threads()} threads; C kernels: {build.instruction_sets()}{gpu}"


def peak_matmul_flops(dtype: torch.dtype, device: torch.device, size: int = 1024, seconds: float = 1.0) -> float:
    """Best sustained FLOP/s of a square matmul of `size`, measured now on `device` in `dtype`."""
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(4):
            torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = max(best, 4 * 2 * size ** 3 / (time.perf_counter() - start))
    return best


def memory_bandwidth(device: torch.device | str = "cpu", num_bytes: int = 512 * 2**20,
                     seconds: float = 1.0) -> float:
    """Best sustained read bandwidth of `device`'s memory in bytes/s: summing a float32 tensor far larger than the
    caches (on CUDA, 4x as large, to outgrow the L2 and the launch cost)."""
    device = torch.device(device)
    if device.type == "cuda":
        num_bytes *= 4
    data = torch.ones(num_bytes // 4, device=device)
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        data.sum()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = max(best, num_bytes / (time.perf_counter() - start))
    return best


def kv_bytes_per_token(hf_config, element_bytes: int) -> int:
    """Bytes of K and V one cached token holds over all layers, at `element_bytes` per value."""
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return 2 * hf_config.num_hidden_layers * kv_heads * head_dim * element_bytes


def model_flops(hf_config, prompt_len: int, output_len: int) -> float:
    """Matmul FLOPs a request needs at minimum: projections for every computed token, attention over its
    context, and the LM head only where a token is sampled."""
    hidden, layers = hf_config.hidden_size, hf_config.num_hidden_layers
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    per_layer = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden \
        + 3 * hidden * hf_config.intermediate_size
    computed = prompt_len + output_len - 1  # the last sampled token is never fed back
    context_sum = computed * (computed + 1) / 2  # token at position p attends to p + 1 keys
    attention = 4 * layers * heads * head_dim * context_sum
    return 2 * layers * per_layer * computed + attention + 2 * hidden * hf_config.vocab_size * output_len
