"""Helpers for the child processes pagellm starts (worker ranks, engine replicas): how worker ranks are started,
running a child's work on a fresh thread, dying with the parent, and being stopped by it; and, for processes that
serve until they end, freezing the heap startup built.

The worker ranks' start method, as vLLM picks it: fork where that is safe, since a forked child starts at once and
never imports the main script again (so a script without an `if __name__ == '__main__':` guard works); else spawn,
with a warning, since each spawned child imports the main script again. Fork is unsafe on other systems than Linux,
when CUDA is initialised (a forked child cannot use it), when torch.distributed is (the child would inherit the
parent's process group), and while other threads run (the child would inherit any lock they hold, with no thread to
release it). Threads that only wait (marked with `quiet_thread`, and tqdm's monitor) do not count.
PAGELLM_WORKER_MULTIPROC_METHOD=fork|spawn|forkserver overrides the choice, as vLLM's VLLM_WORKER_MULTIPROC_METHOD
does.
"""
from __future__ import annotations

import ctypes
import gc
import multiprocessing
import os
import signal
import sys
import threading
import weakref
from collections.abc import Callable
from multiprocessing.context import BaseContext, ForkContext, ForkServerContext, SpawnContext
from multiprocessing.process import BaseProcess
from typing import Any, cast

import torch
import torch.distributed as dist

from pagellm import envs
from pagellm.logger import init_logger

logger = init_logger(__name__)

GUARD = "if __name__ == '__main__':"

_quiet_threads: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


def get_mp_context() -> ForkContext | SpawnContext | ForkServerContext:
    """The context to start worker ranks with: the method PAGELLM_WORKER_MULTIPROC_METHOD names, else fork where
    it is safe, else spawn."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):  # the flag multiprocessing's own check reads
        # A spawned child importing the main script: that script would start pagellm again in every child.
        raise RuntimeError(f"pagellm was started while this process, a child started with spawn or forkserver, "
                           f"imports the main script again. Wrap the script's entry point in `{GUARD}`.")
    method = envs.worker_multiproc_method()
    if method is None:
        reason = _fork_unsafe_reason()
        if reason is not None:
            _log_spawn(reason)
        method = "spawn" if reason else "fork"
    # typeshed types get_context(str) as BaseContext, which lacks Process; every start method's context has it.
    return cast(ForkContext | SpawnContext | ForkServerContext, multiprocessing.get_context(method))


def startup_hint(context: BaseContext) -> str:
    """A sentence for the error when a child started by `context` dies while starting: under spawn or forkserver it
    may have died importing the main script."""
    if context.get_start_method() == "fork" or not _main_is_imported_again():
        return ""
    return (f" A child started with {context.get_start_method()} first imports the main script again: if the script "
            f"starts pagellm at import time, wrap its entry point in `{GUARD}`.")


def quiet_thread(thread: threading.Thread) -> threading.Thread:
    """Mark `thread` as one that only waits (on a process, a pipe or a thread) holding no lock a child would need:
    it does not make forking unsafe."""
    _quiet_threads.add(thread)
    return thread


def run_on_new_thread(target: Callable[..., None], *args: Any) -> None:
    """A child's work: `target(*args)` on a new thread, raising what it raised. A forked child's main thread keeps the
    parent's OpenMP pool (GNU libgomp, torch's intra-op threads), whose threads did not survive the fork: its next
    parallel region would wait for them forever. A new thread gets a pool of its own."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            target(*args)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, name=multiprocessing.current_process().name)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]


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


def _fork_unsafe_reason() -> str | None:
    if sys.platform != "linux":
        return f"fork is not safe on {sys.platform}"
    if torch.cuda.is_initialized():
        return "CUDA is initialized in this process, and a forked child cannot use it"
    if dist.is_available() and dist.is_initialized():
        return "torch.distributed is initialized in this process, and a forked child would inherit its process group"
    current = threading.current_thread()
    others = [thread.name for thread in threading.enumerate() if thread is not current and not _is_quiet(thread)]
    if others:
        return (f"other threads run in this process ({', '.join(others)}), and a forked child would inherit any lock "
                f"they hold")
    return None


def _is_quiet(thread: threading.Thread) -> bool:
    # tqdm's monitor (any progress bar starts it, a disabled one too, and it outlives them) only refreshes bars.
    return thread in _quiet_threads or type(thread).__module__ == "tqdm._monitor"


def _main_is_imported_again() -> bool:
    """Whether spawn imports the main module again in each child, as multiprocessing.spawn decides: a script or a
    module run with `python -m`, but not a package's `__main__`, `python -c`, an interactive session or IPython."""
    main = sys.modules["__main__"]
    name = getattr(getattr(main, "__spec__", None), "name", None)
    if name is not None:
        return name != "__main__" and not name.endswith(".__main__")
    path = getattr(main, "__file__", None)
    return path is not None and os.path.splitext(os.path.basename(path))[0] != "ipython"


def _log_spawn(reason: str) -> None:
    guard = (f" Each child imports the main script again: wrap its entry point in `{GUARD}`."
             if _main_is_imported_again() else "")
    log = logger.warning if guard else logger.info
    log("Starting child processes with spawn, not fork: %s.%s PAGELLM_WORKER_MULTIPROC_METHOD=%s picks the method.",
        reason, guard, "|".join(envs.WORKER_MULTIPROC_METHODS))


def freeze_startup_heap() -> None:
    """Move what startup built (the model, the tokenizer, the app: over 300,000 objects on the default model) out of
    the cyclic collector's reach for the rest of the process, as vLLM's engine core does: a full collection walking it
    paused the process 10-170 ms (measured during the default model's start). Only for processes that serve until
    they end (the API server, a data-parallel replica): an offline engine's objects may die long before its user's
    process, and frozen cycles are never freed."""
    gc.collect()
    gc.freeze()
