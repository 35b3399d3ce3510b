"""Every C kernel is built for one instruction set, whatever the CPU has beyond it: AVX2, FMA and F16C (x86-64-v3)
where the CPU has them. Built with -march=native, the AMD EPYCs (AVX-512) here summed RMSNorm's squares 16 floats
wide and the Intel Xeons (AVX-512, tuned for 256-bit vectors) 8 wide, so the two computed different logprobs. The one
exception is written by hand: linear_cpu.c's AVX-512 tiles and small-M kernels (functions named *_avx512), which
compute the AVX2 kernels' floats (tests/kernels/test_linear_cpu.py checks that)."""
from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from pagellm.kernels import build, decoder, elementwise, linear, paged_attention


@pytest.mark.parametrize("kernel", [linear, elementwise, paged_attention, decoder], ids=lambda m: m.__name__)
def test_no_kernel_holds_an_avx512_instruction(kernel):
    objdump = shutil.which("objdump")
    if objdump is None or not build.has_avx2():
        pytest.skip("needs objdump and an x86 CPU with AVX2")
    library = kernel.load()
    assert library is not None, "the C kernels must build on the test machine (gcc is required)"
    disassembly = subprocess.run([objdump, "-d", library._name], capture_output=True, text=True, check=True).stdout
    # %zmm: the registers of every 512-bit instruction; objdump heads each function with "<name>:"
    wide = set(re.findall(r"<([^>]+)>:\n(?:(?!\n\n).)*?%zmm", disassembly, flags=re.S))
    assert all("_avx512" in function for function in wide), wide
    assert (kernel is linear) == bool(wide)
    assert "%ymm" in disassembly  # built for AVX2 (the AVX2 functions of linear_cpu.c carry their own target)
