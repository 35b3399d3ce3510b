"""Who this process is among the ranks: the global process group and the tensor- and pipeline-parallel groups
carved out of it, each behind a `GroupCoordinator` that knows its rank and runs the group's collectives.

Ranks are laid out as vLLM lays them out, tensor-parallel ranks adjacent: global rank = pp_rank * tp + tp_rank.
Until `initialize_model_parallel` runs, both groups are this process alone (size 1, collectives return their
input), so the single-process engine needs no process group at all.

A pipeline stage holds a contiguous range of the decoder layers (`stage_layer_range`) and passes its activations
to the next stage with point-to-point `send_next` / `recv_prev` over the PP group.

Order, in every rank's process, before the model is built (its layers read their group when constructed):
    init_distributed_environment(world_size, rank, "tcp://host:port" or "file:///path", backend)
    initialize_model_parallel(tensor_parallel_size, pipeline_parallel_size)
and `destroy_model_parallel()`, then `destroy_distributed_environment()`, at shutdown.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class GroupCoordinator:
    """One process group as seen from this rank: `rank` within the group, its size, and its collectives. With one
    rank the collectives return their input unchanged and `group` is None."""
    rank: int
    world_size: int
    ranks: list[int]  # global ranks of the members, in group-rank order
    group: dist.ProcessGroup | None = None

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The elementwise sum over the group, in place."""
        if self.world_size > 1:
            dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `tensor` (same shape on each) concatenated along `dim` in group-rank order."""
        if self.world_size == 1:
            return tensor
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor, group=self.group)
        return torch.cat(parts, dim=dim)

    @property
    def is_first_rank(self) -> bool:
        return self.rank == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank == self.world_size - 1

    def send_next(self, tensor: torch.Tensor) -> None:
        """Send `tensor` to the next rank of the group (blocks until it is received: gloo has no buffering)."""
        dist.send(tensor.contiguous(), dst=self.ranks[self.rank + 1], group=self.group)

    def recv_prev(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A tensor of this shape and dtype from the previous rank of the group (the receiver must know both)."""
        tensor = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(tensor, src=self.ranks[self.rank - 1], group=self.group)
        return tensor


def _single_rank() -> GroupCoordinator:
    return GroupCoordinator(rank=0, world_size=1, ranks=[0])


_TP: GroupCoordinator = _single_rank()
_PP: GroupCoordinator = _single_rank()


def get_tp_group() -> GroupCoordinator:
    return _TP


def get_pp_group() -> GroupCoordinator:
    return _PP


def stage_layer_range(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """The [start, end) decoder layers pipeline stage `pp_rank` of `pp_size` holds: an even split, the earlier
    stages taking one more layer each while the remainder lasts."""
    base, remainder = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, remainder)
    return start, start + base + (pp_rank < remainder)


def init_distributed_environment(world_size: int, rank: int, distributed_init_method: str = "env://",
                                 backend: str | None = None) -> None:
    """Join the global process group (`torch.distributed.init_process_group`); `backend` None picks nccl when CUDA
    is available, else gloo. One rank needs no group and creates none; a second call with the same world size is
    a no-op."""
    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise RuntimeError(f"torch.distributed is already initialized with world size {dist.get_world_size()}, "
                               f"not {world_size}.")
        return
    if world_size == 1:
        return
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    dist.init_process_group(backend, init_method=distributed_init_method, world_size=world_size, rank=rank)


def initialize_model_parallel(tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1) -> None:
    """Create the tensor- and pipeline-parallel groups; every rank must call it with the same sizes, whose product
    must be the global world size."""
    global _TP, _PP
    world_size = tensor_parallel_size * pipeline_parallel_size
    global_world = dist.get_world_size() if dist.is_initialized() else 1
    if world_size != global_world:
        raise RuntimeError(f"tensor_parallel_size ({tensor_parallel_size}) x pipeline_parallel_size "
                           f"({pipeline_parallel_size}) is {world_size}, but the process group has {global_world} "
                           f"ranks; call init_distributed_environment({world_size}, ...) first.")
    if world_size == 1:
        _TP, _PP = _single_rank(), _single_rank()
        return
    rank = dist.get_rank()
    tp_ranks = [[pp * tensor_parallel_size + tp for tp in range(tensor_parallel_size)]
                for pp in range(pipeline_parallel_size)]
    pp_ranks = [[pp * tensor_parallel_size + tp for pp in range(pipeline_parallel_size)]
                for tp in range(tensor_parallel_size)]
    # new_group is collective over the whole world: every rank creates every group, in the same order.
    _TP = _coordinator_for(rank, tp_ranks)
    _PP = _coordinator_for(rank, pp_ranks)


def _coordinator_for(rank: int, all_groups: list[list[int]]) -> GroupCoordinator:
    mine = None
    for ranks in all_groups:
        group = dist.new_group(ranks) if len(ranks) > 1 else None
        if rank in ranks:
            mine = GroupCoordinator(ranks.index(rank), len(ranks), ranks, group)
    return mine


def destroy_model_parallel() -> None:
    """Drop the tensor- and pipeline-parallel groups; afterwards both are this process alone again."""
    global _TP, _PP
    for coordinator in (_TP, _PP):
        if coordinator.group is not None:
            dist.destroy_process_group(coordinator.group)
    _TP, _PP = _single_rank(), _single_rank()


def destroy_distributed_environment() -> None:
    """Leave the global process group (if this process joined one)."""
    if dist.is_initialized():
        dist.destroy_process_group()
