"""Weight files read whole or mapped: the same bytes, and a mapped file costs a rank only the pages it touches; a file
that one read does not return whole (over ~2 GiB on Linux) is read in several."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from pagellm.model_executor.model_loader.file_reader import read_file, read_into

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


class ChunkedFile:
    """An unbuffered file whose every read returns at most `chunk` bytes, as Linux caps one read at ~2 GiB."""

    def __init__(self, path: Path, chunk: int) -> None:
        self.f, self.chunk, self.reads = open(path, "rb", buffering=0), chunk, 0

    def readinto(self, view) -> int:
        self.reads += 1
        return self.f.readinto(view[:self.chunk])


def test_a_file_that_comes_in_several_reads_is_read_whole(tmp_path):
    path = tmp_path / "weights.bin"
    data = torch.randint(0, 256, (10_000,), dtype=torch.uint8)
    path.write_bytes(data.numpy().tobytes())
    buffer = torch.empty(10_000, dtype=torch.uint8)
    f = ChunkedFile(path, 3_000)
    read_into(f, memoryview(buffer.numpy()), path)
    f.f.close()
    assert torch.equal(buffer, data) and f.reads == 4


def test_a_file_shorter_than_expected_is_an_error(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(100))
    f = ChunkedFile(path, 64)
    with pytest.raises(OSError, match="Short read .* 100 of 200 bytes"):
        read_into(f, memoryview(bytearray(200)), path)
    f.f.close()
