"""Which CPU cores a rank's threads run on (`--cpu-affinity`, vLLM's VLLM_CPU_OMP_THREADS_BIND), and binding the
rank's process to them.

Ranks that compute at the same time (the tensor-parallel ranks, the pipeline stages in flight with
pipeline_overlap, and every data-parallel replica's ranks) each get a slot; `auto` splits the cores this process may
run on into one contiguous, disjoint group per slot, and a list names the groups: "0-3|4-7" (slots separated by "|",
replica after replica). A bound rank runs one OpenMP thread per core of its group, each thread pinned to its core
(kernels/affinity.py), so kernel threads neither migrate nor meet another rank's.
"""
from __future__ import annotations

import os

import torch

from pagellm.kernels import affinity
from pagellm.logger import init_logger

logger = init_logger(__name__)


def parse_cores(text: str) -> list[int]:
    """"0-3,8" -> [0, 1, 2, 3, 8]."""
    cores: list[int] = []
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        if not first.isdigit() or (last and not last.isdigit()) or (last and int(last) < int(first)):
            raise ValueError(f"--cpu-affinity: {text!r} is not a core list such as 0-3,8")
        cores.extend(range(int(first), int(last or first) + 1))
    return cores


def slot_groups(spec: str, slots: int, available: list[int]) -> list[list[int]]:
    """Each slot's cores: `auto` splits `available` evenly (slots beyond the cores share them, one core each, round
    robin), a list is read as given and checked against `available`."""
    if spec == "auto":
        if slots > len(available):
            return [[available[slot % len(available)]] for slot in range(slots)]
        return [available[len(available) * s // slots:len(available) * (s + 1) // slots] for s in range(slots)]
    groups = [parse_cores(group) for group in spec.split("|")]
    if len(groups) != slots:
        raise ValueError(f"--cpu-affinity names {len(groups)} core groups ({spec!r}) for {slots} ranks that run at "
                         f"once (tensor x concurrent pipeline stages x data-parallel replicas); give one group per "
                         f"rank, separated by '|', or 'auto'.")
    missing = sorted({core for group in groups for core in group} - set(available))
    if missing:
        raise ValueError(f"--cpu-affinity names cores {missing} that this process cannot run on (it may use "
                         f"{format_cores(available)}).")
    return groups


def format_cores(cores: list[int]) -> str:
    return ",".join(str(core) for core in cores)


def available_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def bind_to_cores(cores: list[int]) -> None:
    """This process runs on `cores` only, with one OpenMP thread pinned to each."""
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
    if not affinity.pin_threads(cores):
        logger.warning("Could not pin the OpenMP threads one per core; the process is bound to cores %s only.",
                       format_cores(cores))
