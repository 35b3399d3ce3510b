"""Compile pagellm's C kernels on first use and load them with ctypes.

Each C source ships with the package and is compiled with the machine's C compiler (gcc or cc) into the pagellm
cache directory, keyed by the source (and the headers beside it), flags, compiler and CPU, so later runs just
load it. If no compiler is there or the build fails, `load_library` returns None and callers use their PyTorch
path. Libraries built with OpenMP link `libgomp.so.1`, which resolves to the copy PyTorch already loaded: one
thread pool for both.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from pagellm import envs
from pagellm.logger import init_logger

logger = init_logger(__name__)


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), platform.processor())
    except OSError:
        return platform.processor()


def _build(source: Path, flags: list[str], compiler: str) -> Path:
    headers = [h.read_text() for h in sorted(source.parent.glob("*.h"))]  # sources may include any of them
    key = hashlib.sha256("\0".join([source.read_text(), *headers, *flags, compiler, _cpu_signature()]).encode())
    target = envs.cache_root() / "kernels" / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        subprocess.run([compiler, *flags, str(source), "-o", str(built), "-lm"], check=True,
                       capture_output=True, text=True)
        os.replace(built, target)  # atomic: a concurrent build never exposes a half-written library
    return target


def load_library(source: Path, flags: list[str], what: str) -> ctypes.CDLL | None:
    """The compiled `source`, or None (with a warning naming `what` falls back) when it cannot be built."""
    if envs.c_kernels_disabled():
        return None
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        logger.warning("No C compiler found; %s uses the slower PyTorch path.", what)
        return None
    try:
        return ctypes.CDLL(str(_build(source, flags, compiler)))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        logger.warning("Building the C kernel for %s failed (%s); using the PyTorch path.", what, detail)
        return None
