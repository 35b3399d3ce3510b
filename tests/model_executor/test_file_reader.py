"""Weight files read whole or mapped: the same bytes, and a mapped file costs a rank only the pages it touches."""
from __future__ import annotations

import re
from pathlib import Path

import torch

from pagellm.model_executor.model_loader.file_reader import read_file

FILE_BYTES = 64 << 20
SLICE_BYTES = 1 << 20


def file_backed_resident_bytes() -> int:
    """RssFile: pages of mapped files this process has touched (a whole read lands in RssAnon instead)."""
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"^RssFile:\s+(\d+) kB", status, re.MULTILINE).group(1)) * 1024


def test_mapped_equals_read_and_touches_only_its_slice(tmp_path):
    path = tmp_path / "weights.bin"
    data = torch.randint(0, 256, (FILE_BYTES,), dtype=torch.uint8)
    path.write_bytes(data.numpy().tobytes())
    start = FILE_BYTES // 2

    before = file_backed_resident_bytes()
    mapped = read_file(path, mapped=True)
    piece = mapped[start:start + SLICE_BYTES].clone()
    mapped_growth = file_backed_resident_bytes() - before
    assert torch.equal(piece, data[start:start + SLICE_BYTES])
    # The slice's pages came from the mapping (so the file was not read into private memory), and only they did.
    assert SLICE_BYTES // 2 <= mapped_growth < 8 * SLICE_BYTES, mapped_growth

    assert torch.equal(read_file(path), data) and torch.equal(mapped, data)
    # Copy-on-write: writing to the mapping never changes the file.
    mapped[:16] = 0
    assert path.read_bytes()[:16] == data[:16].numpy().tobytes()
