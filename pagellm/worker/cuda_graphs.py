"""CUDA graphs for decode steps: the model's forward over a batch of single-token decodes, captured once per batch
size bucket and replayed, so a decode step costs one graph launch instead of hundreds of kernel launches.

A graph replays fixed addresses and shapes. The step's inputs are copied into static buffers sized for the largest
bucket, and the batch is padded up to its bucket with rows that write their K/V into a scratch block no request
owns (the cache engine allocates it past the scheduler's blocks) and attend to that block alone. Block tables are
as wide as max_model_len allows, so the attention kernel's launch shape is the same at every step.

Each capture is checked before use: the graph replayed on inputs unlike those it was captured with must give the
eager forward's output. A bucket that fails the check or the capture itself is left to eager steps (logged).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from pagellm.logger import init_logger
from pagellm.model_executor.layers.attention import AttentionMetadata

logger = init_logger(__name__)

# Batch sizes captured: every decode batch pads up to the next one (vLLM's choice of sizes).
_SMALL_BUCKETS = (1, 2, 4)
_BUCKET_STEP = 8
MAX_CAPTURED_BATCH = 256

# Capture: (forward to record) -> replay. Tests pass an eager stand-in to check the padding on machines
# without a GPU.
Capture = Callable[[Callable[[], torch.Tensor]], Callable[[], torch.Tensor]]


def batch_buckets(max_batch: int) -> list[int]:
    largest = min(max_batch, MAX_CAPTURED_BATCH)
    sizes = [b for b in _SMALL_BUCKETS if b < largest] + list(range(_BUCKET_STEP, largest, _BUCKET_STEP))
    return [*sizes, largest]


def cuda_capture() -> Capture:
    """Capture into CUDA graphs that share one memory pool."""
    pool = torch.cuda.graph_pool_handle()

    def capture(forward: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        # A warm-up run first, on a side stream as PyTorch asks: Triton compiles its kernels and cuBLAS sets up
        # its workspaces outside the capture.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            output = forward()

        def replay() -> torch.Tensor:
            graph.replay()
            return output

        return replay

    return capture


class DecodeGraphs:
    """Captured decode forwards of `model` for each bucket up to `max_batch` sequences."""

    def __init__(self, model, kv_caches: list[torch.Tensor], max_batch: int, max_blocks_per_seq: int,
                 block_size: int, scratch_block: int, device: torch.device, capture: Capture | None = None) -> None:
        self.model, self.kv_caches = model, kv_caches
        self.block_size, self.scratch_block = block_size, scratch_block
        self.buckets = batch_buckets(max_batch)
        largest = self.buckets[-1]

        def buffer(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=device)

        self.input_ids, self.positions, self.slot_mapping, self.seq_lens = (buffer(largest) for _ in range(4))
        self.block_tables = buffer(largest, max_blocks_per_seq)
        self._replays: dict[int, Callable[[], torch.Tensor]] = {}
        capture = capture or cuda_capture()
        for batch in reversed(self.buckets):  # largest first: smaller graphs reuse its memory pool
            self._pad(0, batch)
            try:
                replay = capture(lambda b=batch: self._forward(b))
            except Exception as exc:  # a capture failure costs this bucket its graph, not the engine
                logger.warning("Capturing the decode graph of batch %d failed (%s); it runs eagerly.", batch, exc)
                continue
            if self._replay_matches_eager(batch, replay):
                self._replays[batch] = replay
            else:
                logger.warning("The decode graph of batch %d disagrees with the eager forward; it runs eagerly.",
                               batch)
        logger.info("Decode graphs captured for batch sizes %s.", sorted(self._replays))

    @property
    def captured(self) -> list[int]:
        return sorted(self._replays)

    def _forward(self, batch: int) -> torch.Tensor:
        meta = AttentionMetadata(self.slot_mapping[:batch], batch, self.block_tables[:batch], self.seq_lens[:batch], [])
        return self.model(self.input_ids[:batch], self.positions[:batch], self.kv_caches, meta)

    def _pad(self, start: int, end: int) -> None:
        """Rows start..end become padding: token 0 at position 0, its K/V written to and read from the scratch block."""
        self.input_ids[start:end] = 0
        self.positions[start:end] = 0
        self.slot_mapping[start:end] = self.scratch_block * self.block_size
        self.seq_lens[start:end] = 1
        self.block_tables[start:end] = self.scratch_block

    def _replay_matches_eager(self, batch: int, replay: Callable[[], torch.Tensor]) -> bool:
        """Replay on other tokens, positions and lengths than the capture saw (all within the scratch block, so no
        request's cache is touched) and compare with the eager forward on the same buffers. Rows that share a
        slot are identical, so the order of their cache writes cannot matter."""
        position = torch.arange(batch, device=self.input_ids.device) % self.block_size
        self.positions[:batch] = position
        self.seq_lens[:batch] = position + 1
        self.slot_mapping[:batch] = self.scratch_block * self.block_size + position
        self.input_ids[:batch] = position * 7 + 1
        replayed = replay().clone()
        eager = self._forward(batch)
        self._pad(0, batch)
        return bool(torch.allclose(replayed.float(), eager.float(), rtol=1e-2, atol=1e-2))

    def bucket(self, num_decodes: int) -> int | None:
        """The captured batch size a step of `num_decodes` decodes pads to, or None (it runs eagerly)."""
        return next((b for b in self.buckets if b >= num_decodes and b in self._replays), None)

    def run(self, batch: int, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        """The hidden states of a decode-only step's `meta.num_decodes` rows, through the graph of `batch`."""
        n, width = meta.num_decodes, meta.decode_block_tables.shape[1]
        self.input_ids[:n] = input_ids
        self.positions[:n] = positions
        self.slot_mapping[:n] = meta.slot_mapping
        self.seq_lens[:n] = meta.decode_seq_lens
        # Columns past `width` keep earlier steps' entries: the kernel reads no token past a row's length.
        self.block_tables[:n, :width] = meta.decode_block_tables
        self._pad(n, batch)
        return self._replays[batch]()[:n]
