"""The line every benchmark prints before its figures: the CPU (as lscpu names it) and the instruction sets the C
kernels use there, since the same run gives other figures on another kind of machine."""
from __future__ import annotations

import platform
import shutil
import subprocess

import pytest

from pagellm.benchmarks.machine import machine_header


def lscpu() -> dict[str, str]:
    if shutil.which("lscpu") is None:
        pytest.skip("no lscpu")
    lines = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines()
    return {key.strip(): value.strip() for key, _, value in (line.partition(":") for line in lines)}


def test_names_the_cpu_as_lscpu_does_and_the_kernels_instruction_sets(monkeypatch):
    monkeypatch.delenv("PAGELLM_CPU_ISA", raising=False)
    monkeypatch.delenv("PAGELLM_DISABLE_C_KERNELS", raising=False)
    info = lscpu()
    header = machine_header()
    assert header.startswith(f"CPU: {info['Model name']}, ")
    flags = set(info.get("Flags", "").split())
    vector = {"avx2", "fma", "f16c"} <= flags
    assert f"C kernels: {'AVX2+FMA+F16C' if vector else f'portable scalar ({platform.machine()} baseline)'}" in header
    assert ("AVX-512F matmul kernels" in header) == (vector and "avx512f" in flags)


def test_says_when_the_kernels_are_portable_or_off(monkeypatch):
    monkeypatch.setenv("PAGELLM_CPU_ISA", "scalar")
    assert "C kernels: portable scalar (" in machine_header()
    monkeypatch.setenv("PAGELLM_DISABLE_C_KERNELS", "1")
    assert "C kernels: none (PAGELLM_DISABLE_C_KERNELS: PyTorch)" in machine_header()
