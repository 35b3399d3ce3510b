"""Helpers for the child processes pagellm spawns (worker ranks, engine replicas): dying with the parent, and
being stopped by it."""
from __future__ import annotations

import ctypes
import signal
from multiprocessing.process import BaseProcess


def die_with_parent() -> None:
    """Linux: have the kernel kill this process when its parent dies, however the parent ends, so no orphan is
    left behind."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL)


def kill_processes(processes: list[BaseProcess]) -> None:
    """Kill those still running and reap them all (a finalizer's last resort after a graceful stop)."""
    for process in processes:
        if process.is_alive():
            process.kill()
        process.join()
