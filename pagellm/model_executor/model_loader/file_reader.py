"""Weight files into memory: the one place that decides between reading a file and mapping it."""
from __future__ import annotations

import os

import numpy as np
import torch


def read_file(path: str | os.PathLike, mapped: bool = False) -> torch.Tensor:
    """A weight file's bytes as one uint8 tensor: read in one go, or mapped copy-on-write when `mapped`.

    One sequential read is the fast way for a process that keeps the whole model: page-faulting a mapping in 4 KiB
    steps was 4x slower on the machines we measured, and the weights are copied into the model anyway. A tensor-
    or pipeline-parallel rank keeps only a slice, so it maps the file instead: it reads only the pages its slices
    touch, and the ranks on one machine share the page cache rather than each holding a private copy.
    """
    if mapped:
        return torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="c"))
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        buffer = torch.empty(size, dtype=torch.uint8)
        read_into(f, memoryview(buffer.numpy()), path)
    return buffer


def read_into(f, view: memoryview, path: str | os.PathLike) -> None:
    """Fill `view` from the unbuffered file `f`. One read returns at most ~2 GiB on Linux (a real model's 2.5 GB
    safetensors file comes in two), so read until the view is full."""
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            raise OSError(f"Short read from {path}: {done} of {len(view)} bytes; the file changed while loading?")
        done += n
