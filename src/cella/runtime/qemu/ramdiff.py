"""RAM layers: the pages a restored VM has written since its restore, saved on top of the RAM
file it was restored from, and put back into a new VM (or into a flat file) from there.

A VM restored from a snapshot maps the snapshot's RAM file privately: a page it never wrote
is the file's page, a page it wrote is an anonymous copy-on-write page of its own. The
kernel says which is which in `/proc/PID/pagemap`, so a stopped VM's layer is exactly its
anonymous pages, read through `/proc/PID/mem`; the pause it costs grows with what the VM
changed, not with its RAM.

A layer is two files: `ram.index`, pairs of (first page, page count) as little-endian
uint64, and `ram.layer`, those runs' pages one after another.
"""

from __future__ import annotations

import os
import re
from array import array
from collections.abc import Callable, Iterator
from pathlib import Path

PAGE = 4096
CHUNK = 8 << 20  # bytes per read or write: large runs are moved in pieces

# pagemap flag bits in an entry's top byte: present (63), swapped (62), file page (61).
# A page of ours is a present anonymous one or a swapped one.
_OURS = bytes(1 if (b & 0x40) or ((b & 0x80) and not (b & 0x20)) else 0 for b in range(256))
Runs = list[tuple[int, int]]


def ram_mapping(pid: int, ram_file: Path) -> int:
    """Where the process has `ram_file` mapped (the guest's RAM)."""
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].strip() == str(ram_file) and fields[2] == "00000000":
                return int(fields[0].split("-")[0], 16)
    raise FileNotFoundError(f"process {pid} has no mapping of {ram_file}")


def written_runs(pid: int, address: int, size: int) -> Runs:
    """Runs of pages in [address, address + size) the process has written (its own copies)."""
    pages = size // PAGE
    with open(f"/proc/{pid}/pagemap", "rb", buffering=0) as pagemap:
        pagemap.seek(address // PAGE * 8)
        entries = bytearray()
        while len(entries) < pages * 8:
            got = pagemap.read(pages * 8 - len(entries))
            if not got:
                break
            entries += got
    ours = bytes(entries[7::8]).translate(_OURS)
    return [(m.start(), m.end() - m.start()) for m in re.finditer(b"\x01+", ours)]


def read_layer(pid: int, address: int, runs: Runs) -> list[bytes]:
    """The runs' pages from the process's memory (while it is stopped: fast, in memory)."""
    mem = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
    try:
        pieces = []
        for offset, length in _pieces(runs):
            data = os.pread(mem, length, address + offset)
            if len(data) != length:
                raise OSError(f"short read of guest memory at {offset:#x}")
            pieces.append(data)
        return pieces
    finally:
        os.close(mem)


def write_layer(runs: Runs, pieces: list[bytes], directory: Path) -> int:
    """Writes a layer read by `read_layer` to `directory`; returns its bytes. (Writing to
    the file system is several times slower than reading guest memory: the VM runs on
    meanwhile.)"""
    (directory / "ram.index").write_bytes(array("Q", [n for run in runs for n in run]).tobytes())
    with open(directory / "ram.layer", "wb") as out:
        for piece in pieces:
            out.write(piece)
    return sum(len(p) for p in pieces)


def layer_bytes(runs: Runs) -> int:
    return sum(count for _, count in runs) * PAGE


def read_index(directory: Path) -> Runs:
    raw = array("Q")
    raw.frombytes((directory / "ram.index").read_bytes())
    return list(zip(raw[0::2], raw[1::2], strict=True))


def load_layer(pid: int, address: int, directory: Path) -> None:
    """Writes a layer into a process's guest RAM (a new VM, before its vCPUs run)."""
    mem = os.open(f"/proc/{pid}/mem", os.O_WRONLY)
    try:
        _copy_pieces(directory, lambda data, offset: os.pwrite(mem, data, address + offset))
    finally:
        os.close(mem)


def flatten(base: Path, directory: Path, dest: Path) -> None:
    """A whole RAM file: `base` with the layer in `directory` written over it (holes stay
    holes: the base's data extents are copied in the kernel, without reading them here)."""
    src = os.open(base, os.O_RDONLY)
    out = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        size = os.fstat(src).st_size
        os.ftruncate(out, size)
        offset = 0
        while offset < size:
            try:
                start = os.lseek(src, offset, os.SEEK_DATA)
            except OSError:  # no data after offset
                break
            end = os.lseek(src, start, os.SEEK_HOLE)
            at = start
            while at < end:
                copied = os.copy_file_range(src, out, end - at, at, at)
                if copied == 0:
                    raise OSError(f"{base} ended while being copied")
                at += copied
            offset = end
        _copy_pieces(directory, lambda data, at: os.pwrite(out, data, at))
        os.fsync(out)
    finally:
        os.close(src)
        os.close(out)


def _copy_pieces(directory: Path, write: Callable[[bytes, int], int]) -> None:
    runs = read_index(directory)
    with open(directory / "ram.layer", "rb", buffering=0) as layer:
        for offset, length in _pieces(runs):
            data = layer.read(length)
            if len(data) != length:
                raise OSError("the RAM layer is shorter than its index")
            written = write(data, offset)
            if written != length:
                raise OSError(f"short write of guest memory at {offset:#x}")


def _pieces(runs: Runs) -> Iterator[tuple[int, int]]:
    """(byte offset, length) of the runs, in pieces of at most CHUNK bytes."""
    for first, count in runs:
        offset, end = first * PAGE, (first + count) * PAGE
        while offset < end:
            length = min(CHUNK, end - offset)
            yield offset, length
            offset += length
