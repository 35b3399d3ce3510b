"""How one engine spreads over ranks: `ParallelConfig` (tensor, pipeline and data parallel sizes, the executor
backend, CPU cores per rank) and the rank arithmetic derived from it."""
from __future__ import annotations

from dataclasses import dataclass

DISTRIBUTED_EXECUTOR_BACKENDS = ("uni", "mp", "ray")


@dataclass(kw_only=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # None: "uni" (this process) for one rank, "mp" (one process per rank on this machine) for more.
    distributed_executor_backend: str | None = None
    # Engine replicas behind one server, each with its own scheduler, KV cache and tp x pp ranks; this
    # replica's index among them.
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    # Keep a batch per pipeline stage in flight, so stages work at once (see EngineArgs.pipeline_overlap).
    pipeline_overlap: bool = False
    # CPU cores per rank (worker/cpu_affinity.py): None leaves scheduling to the OS, "auto" splits this process's
    # cores among the ranks that run at once, "0-3|4-7" names them.
    cpu_affinity: str | None = None

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}; fix "
                                 f"--{name.replace('_', '-')}.")
        if self.distributed_executor_backend is None:
            self.distributed_executor_backend = "uni" if self.world_size == 1 else "mp"
        if self.distributed_executor_backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of {', '.join(DISTRIBUTED_EXECUTOR_BACKENDS)}, "
                             f"got {self.distributed_executor_backend!r}; fix --distributed-executor-backend.")
        if self.distributed_executor_backend == "uni" and self.world_size > 1:
            raise ValueError(f"The 'uni' executor runs one rank in this process, but tensor x pipeline parallel "
                             f"size is {self.world_size}; use --distributed-executor-backend mp or ray.")

    @property
    def concurrent_ranks(self) -> int:
        """Ranks computing at the same time on this machine, every replica's: each gets its own cores."""
        return self.tensor_parallel_size * self.concurrent_stages * self.data_parallel_size

    def cpu_slot(self, rank: int) -> int:
        """Rank `rank` (of this replica)'s place among the concurrent ranks: stages that take turns share one."""
        stage, tp_rank = divmod(rank, self.tensor_parallel_size)
        return ((self.data_parallel_rank * self.concurrent_stages + stage % self.concurrent_stages)
                * self.tensor_parallel_size + tp_rank)

    @property
    def concurrent_stages(self) -> int:
        """Pipeline stages that compute at the same time: all of them with pipeline_overlap, else one."""
        return self.pipeline_parallel_size if self.pipeline_overlap else 1

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def output_rank(self) -> int:
        """The rank whose step result the engine uses: the last pipeline stage's first tensor-parallel rank (the
        only stage that computes logits; ranks are laid out pp_rank * tp + tp_rank)."""
        return (self.pipeline_parallel_size - 1) * self.tensor_parallel_size

    def pp_rank(self, rank: int) -> int:
        """The pipeline stage of global rank `rank`."""
        return rank // self.tensor_parallel_size
