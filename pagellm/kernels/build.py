"""Compile pagellm's C kernels on first use and load them with ctypes.

Each C source ships with the package and is compiled with the machine's C compiler (gcc or cc) into the pagellm
cache directory, keyed by the source (and the headers beside it), flags, compiler and CPU, so later runs just
load it. Kernels are built for a fixed instruction set (`isa_flags`), never -march=native, so that any two CPUs
with AVX2 compute the same floats. If no compiler is there or the build fails, `load_library` returns None and
callers use their PyTorch path. Libraries built with OpenMP link `libgomp.so.1`, which resolves to the copy
PyTorch already loaded: one thread pool for both.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

from pagellm import envs
from pagellm.logger import init_logger

logger = init_logger(__name__)


@cache
def _cpuinfo(field: str) -> str:
    """The first `field` line's value in /proc/cpuinfo ("" where there is none: not Linux, or not this field)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.split(":", 1)[0].strip() == field), "")
    except OSError:
        return ""


def _cpu_signature() -> str:
    return _cpuinfo("flags") or platform.processor()


def cpu_model() -> str:
    """The CPU's model name, as lscpu prints it ("AMD EPYC", "Intel(R) Xeon(R) Platinum 8480+")."""
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def has_avx2() -> bool:
    """Whether the CPU has AVX2, FMA and F16C: the vector kernels' instruction sets."""
    return platform.machine() in ("x86_64", "AMD64") and {"avx2", "fma", "f16c"} <= set(_cpuinfo("flags").split())


def isa_flags() -> list[str]:
    """The flags that set a kernel's instruction set (linear_cpu.c's AVX2 functions carry their own target
    attribute instead): x86-64-v3 (AVX2, FMA, F16C) where the CPU has them, else the compiler's baseline (also with
    PAGELLM_CPU_ISA=scalar). Never -march=native: gcc 12 then vectorised RMSNorm's sum of squares 16 floats wide on
    an AMD EPYC with AVX-512 and 8 wide on an Intel Xeon with AVX-512 (tuned for 256-bit vectors): another rounding,
    other logprobs. No kernel uses AVX-512, VNNI or AMX."""
    return ["-march=x86-64-v3"] if has_avx2() and envs.cpu_isa() != "scalar" else []


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def instruction_sets() -> str:
    """The instruction sets the C kernels run with on this machine, as a benchmark header names them."""
    if envs.c_kernels_disabled():
        return "none (PAGELLM_DISABLE_C_KERNELS: PyTorch)"
    if _compiler() is None:
        return "none (no C compiler: PyTorch)"
    return "AVX2+FMA+F16C" if isa_flags() else f"portable scalar ({platform.machine()} baseline)"


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
    compiler = _compiler()
    if compiler is None:
        logger.warning("No C compiler found; %s uses the slower PyTorch path.", what)
        return None
    try:
        return ctypes.CDLL(str(_build(source, flags, compiler)))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        logger.warning("Building the C kernel for %s failed (%s); using the PyTorch path.", what, detail)
        return None
