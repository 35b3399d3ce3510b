"""Compile pagellm's C kernels on first use, load them with ctypes, and declare their C signatures to ctypes.

Each C source ships with the package and is compiled with the machine's C compiler (gcc or cc) into the pagellm
cache directory (`kernel_cache_dir()`), keyed by the source, the headers and fragments beside it, flags, compiler
and CPU, so later runs just load it. Kernels are built for a fixed instruction set (`isa_flags`), never
-march=native, so that any two CPUs with AVX2 compute the same floats. If no compiler is there or the build fails,
`load_library` returns None and callers use their PyTorch path. Libraries built with OpenMP link `libgomp.so.1`,
which resolves to the copy PyTorch already loaded: one thread pool for both.

Each kernel's binding module (`linear.py` for `linear_cpu.c`, and so on) writes its C prototypes as one table of
ctypes signatures, `SIGNATURES`; `load_library` applies it (`bind`), so no caller sets `argtypes` by hand and
tests/kernels/test_bindings.py can check every table against the C source.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path

from pagellm import envs
from pagellm.logger import init_logger

logger = init_logger(__name__)

# A C function as ctypes sees it: (restype, argtypes), restype None for void. Pointers are c_void_p: callers pass
# `tensor.data_ptr()` or `ctypes.addressof(struct)`, plain ints.
Signature = tuple[type | None, Sequence[type]]
# What a source may #include from its own folder: headers, and the textual fragments of linear_cpu.c (*.inc). All
# of them go into every cache key (a source includes whichever it needs); pyproject.toml ships the same patterns.
INCLUDED_PATTERNS = ("*.h", "*.inc")


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


def has_avx512() -> bool:
    """Whether the packed-weight tiles and small-M kernels take their AVX-512F variants here (kernels/linear.py
    `use_avx512` asks the CPU itself; this reads the same flag for benchmark headers, without loading a library)."""
    return has_avx2() and "avx512f" in _cpuinfo("flags").split() and envs.cpu_isa() not in ("scalar", "avx2")


def isa_flags() -> list[str]:
    """The flags that set a kernel's instruction set (linear_cpu.c's AVX2 functions carry their own target
    attribute instead): x86-64-v3 (AVX2, FMA, F16C) where the CPU has them, else the compiler's baseline (also with
    PAGELLM_CPU_ISA=scalar). Never -march=native: gcc 12 then vectorised RMSNorm's sum of squares 16 floats wide on
    an AMD EPYC with AVX-512 and 8 wide on an Intel Xeon with AVX-512 (tuned for 256-bit vectors): another rounding,
    other logprobs. No compiler-chosen AVX-512, VNNI or AMX: the one AVX-512 code is linear_cpu.c's hand-written tile
    variant, which computes the AVX2 tiles' floats (see `has_avx512`)."""
    return ["-march=x86-64-v3"] if has_avx2() and envs.cpu_isa() != "scalar" else []


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def instruction_sets() -> str:
    """The instruction sets the C kernels run with on this machine, as a benchmark header names them."""
    if envs.c_kernels_disabled():
        return "none (PAGELLM_DISABLE_C_KERNELS: PyTorch)"
    if _compiler() is None:
        return "none (no C compiler: PyTorch)"
    if not isa_flags():
        return f"portable scalar ({platform.machine()} baseline)"
    return "AVX2+FMA+F16C" + (", AVX-512F matmul kernels" if has_avx512() else "")


def kernel_cache_dir() -> Path:
    """Where built kernels live: $PAGELLM_CACHE_DIR/kernels (~/.cache/pagellm/kernels). Deleting it forces a
    rebuild on next use; a changed source, header or flag builds a new file beside the old ones anyway."""
    return envs.cache_root() / "kernels"


def included_files(source: Path) -> list[Path]:
    """The files beside `source` that it may #include (`INCLUDED_PATTERNS`), in a fixed order."""
    return sorted({path for pattern in INCLUDED_PATTERNS for path in source.parent.glob(pattern)})


def _build(source: Path, flags: list[str], compiler: str) -> Path:
    # Names as well as contents: a renamed include with unchanged text must still rebuild (the #include changed).
    included = [f"{path.name}\0{path.read_text()}" for path in included_files(source)]
    key = hashlib.sha256("\0".join([source.read_text(), *included, *flags, compiler, _cpu_signature()]).encode())
    target = kernel_cache_dir() / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        subprocess.run([compiler, *flags, str(source), "-o", str(built), "-lm"], check=True,
                       capture_output=True, text=True)
        os.replace(built, target)  # atomic: a concurrent build never exposes a half-written library
    return target


def bind(library: ctypes.CDLL, signatures: Mapping[str, Signature]) -> ctypes.CDLL:
    """Give each function in `signatures` its restype and argtypes: the one place ctypes learns the C prototypes.
    A symbol the library lacks raises AttributeError: the table and the source disagree, a bug, not a fallback."""
    for symbol, (restype, argtypes) in signatures.items():
        function = getattr(library, symbol)
        function.restype, function.argtypes = restype, list(argtypes)
    return library


def load_library(source: Path, flags: list[str], what: str,
                 signatures: Mapping[str, Signature]) -> ctypes.CDLL | None:
    """The compiled `source` with `signatures` bound, or None (with a warning naming `what` falls back) when it
    cannot be built."""
    if envs.c_kernels_disabled():
        return None
    compiler = _compiler()
    if compiler is None:
        logger.warning("No C compiler found; %s uses the slower PyTorch path.", what)
        return None
    try:
        library = ctypes.CDLL(str(_build(source, flags, compiler)))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        logger.warning("Building the C kernel for %s failed (%s); using the PyTorch path.", what, detail)
        return None
    return bind(library, signatures)
