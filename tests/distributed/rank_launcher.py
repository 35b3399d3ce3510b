"""Runs a test function on every rank of a small CPU process group: one spawned process per rank, joined to a
gloo group through a rendezvous file, each returning its result through a file. Every process is joined or
killed before `run_ranks` returns, and a rank that fails stops the others at once instead of leaving them to
wait in a collective."""
from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import torch


def run_ranks(target: Callable[..., Any], tmp_path: Path, tensor_parallel_size: int, pipeline_parallel_size: int = 1,
              args: tuple = (), timeout_s: float = 90.0) -> list[Any]:
    """`target(*args)` on each rank after `init_distributed_environment` and `initialize_model_parallel`; the
    results in rank order. `target` must be a module-level function (the processes are spawned)."""
    world_size = tensor_parallel_size * pipeline_parallel_size
    context = multiprocessing.get_context("spawn")
    init_method = f"file://{tmp_path / 'rendezvous'}"
    processes = [context.Process(target=_rank_main, daemon=True,
                                 args=(target, rank, tensor_parallel_size, pipeline_parallel_size, init_method,
                                       str(tmp_path), args))
                 for rank in range(world_size)]
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout_s
    try:
        running = list(processes)
        while running and time.monotonic() < deadline:
            wait([p.sentinel for p in running], timeout=deadline - time.monotonic())
            running = [p for p in running if p.exitcode is None]
            if any(p.exitcode for p in processes):  # a failed rank: the others would block in a collective
                break
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
            process.join()
    codes = [p.exitcode for p in processes]
    assert all(code == 0 for code in codes), f"rank exit codes {codes} (negative: killed after failure or timeout)"
    return [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(world_size)]


def _rank_main(target: Callable[..., Any], rank: int, tensor_parallel_size: int, pipeline_parallel_size: int,
               init_method: str, out_dir: str, args: tuple) -> None:
    from pagellm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )

    torch.set_num_threads(1)  # the ranks share the machine's cores
    init_distributed_environment(tensor_parallel_size * pipeline_parallel_size, rank, init_method, "gloo")
    try:
        initialize_model_parallel(tensor_parallel_size, pipeline_parallel_size)
        torch.save(target(*args), Path(out_dir) / f"rank{rank}.pt")
    finally:
        destroy_model_parallel()
        destroy_distributed_environment()
