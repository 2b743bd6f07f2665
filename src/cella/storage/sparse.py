"""Files sent as their data only: a RAM file of 512 MiB is mostly holes and zero pages, and
a qcow2 image has holes too, so a node sends another the pieces that hold data and their
offsets (`encode`) and the receiver writes them into a new file of the same size, which
reads the same byte for byte (`Receiver`).

The stream: a header (`MAGIC`, the file's size as a little-endian uint64), then records of
(offset, length) as two little-endian uint64 followed by `length` bytes, in increasing
offsets. All-zero 64 KiB blocks inside data extents are left out as well. The receiver
checks every record against the size and the previous record (a node sending nonsense
fails the pull; the manifest's checksums are still checked afterwards).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from pathlib import Path

from cella import errors

MAGIC = b"CELLA-EXTENTS-1\n"
MEDIA_TYPE = "application/x-cella-extents"
BLOCK = 64 << 10
PIECE = 1 << 20  # bytes read and sent at once
_ZERO = bytes(BLOCK)
_HEADER = struct.Struct("<Q")
_RECORD = struct.Struct("<QQ")


def data_runs(path: Path) -> Iterator[tuple[int, int]]:
    """(offset, length) of the file's non-zero pieces, at most PIECE bytes each, in
    order: its data extents, all-zero 64 KiB blocks left out."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        offset = 0
        while offset < size:
            try:
                start = os.lseek(fd, offset, os.SEEK_DATA)
            except OSError:  # no data after offset (ENXIO)
                return
            end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
            yield from _nonzero(fd, start, end)
            offset = end
    finally:
        os.close(fd)


def _nonzero(fd: int, start: int, end: int) -> Iterator[tuple[int, int]]:
    run_start = None
    block = start
    while block < end:
        chunk = os.pread(fd, min(BLOCK, end - block), block)
        if not chunk:
            break
        if chunk != _ZERO[: len(chunk)]:
            if run_start is None:
                run_start = block
            if block + len(chunk) - run_start >= PIECE:
                yield run_start, block + len(chunk) - run_start
                run_start = None
        elif run_start is not None:
            yield run_start, block - run_start
            run_start = None
        block += len(chunk)
    if run_start is not None:
        yield run_start, block - run_start


def data_bytes(path: Path) -> int:
    """What `encode` sends of the file's contents (its non-zero pieces)."""
    return sum(length for _, length in data_runs(path))


def encode(path: Path) -> Iterator[bytes]:
    """The file as a stream of its non-zero pieces (see the module's doc)."""
    size = path.stat().st_size
    yield MAGIC + _HEADER.pack(size)
    fd = os.open(path, os.O_RDONLY)
    try:
        for offset, length in data_runs(path):
            data = os.pread(fd, length, offset)
            yield _RECORD.pack(offset, len(data)) + data
    finally:
        os.close(fd)


class Receiver:
    """Writes a stream from `encode` into `fd` (a new, empty file) as chunks arrive, in any
    sizes; `close()` checks it ended on a record's end and sets the file's size."""

    def __init__(self, fd: int, limit: int = 1 << 40) -> None:
        self.fd = fd
        self.limit = limit  # the largest file size accepted
        self.size: int | None = None
        self.received = 0  # bytes of the stream
        self._buffer = bytearray()
        self._left = 0  # bytes of the current record still to write
        self._at = 0  # where they go
        self._end = 0  # where the last record ended

    def feed(self, chunk: bytes) -> None:
        self.received += len(chunk)
        self._buffer += chunk
        while self._step():
            pass

    def _step(self) -> bool:
        buf = self._buffer
        if self.size is None:
            need = len(MAGIC) + _HEADER.size
            if len(buf) < need:
                return False
            if bytes(buf[: len(MAGIC)]) != MAGIC:
                raise errors.CellaError("the source sent no extent stream")
            (self.size,) = _HEADER.unpack_from(buf, len(MAGIC))
            if self.size > self.limit:
                raise errors.CellaError(f"the source announced a file of {self.size} bytes")
            del buf[:need]
            return True
        if self._left:
            if not buf:
                return False
            piece = bytes(buf[: self._left])
            written = os.pwrite(self.fd, piece, self._at)
            if written != len(piece):
                raise OSError("short write")
            self._at += written
            self._left -= written
            del buf[:written]
            return True
        if len(buf) < _RECORD.size:
            return False
        offset, length = _RECORD.unpack_from(buf)
        if offset < self._end or offset + length > self.size or length == 0:
            raise errors.CellaError(f"the source sent a bad extent ({offset}, {length})")
        del buf[: _RECORD.size]
        self._at, self._left, self._end = offset, length, offset + length
        return True

    def close(self) -> int:
        """The file's size, once the stream ended where it should."""
        if self.size is None or self._left or self._buffer:
            raise errors.CellaError("the extent stream ended early")
        os.ftruncate(self.fd, self.size)
        return self.size
