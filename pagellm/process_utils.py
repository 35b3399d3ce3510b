"""Helpers for the child processes pagellm spawns (worker ranks, engine replicas)."""
from __future__ import annotations

import ctypes
import signal


def die_with_parent() -> None:
    """Linux: have the kernel kill this process when its parent dies, however the parent ends, so no orphan is
    left behind."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
