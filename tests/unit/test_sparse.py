"""Files sent as their data only (`storage/sparse.py`): what arrives reads the same byte for
byte, holes and zero blocks are not sent, and a stream that lies is refused."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cella import errors
from cella.storage import sparse


def received(src: Path, dest: Path, chunk: int) -> sparse.Receiver:
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        receiver = sparse.Receiver(fd)
        stream = b"".join(sparse.encode(src))
        for start in range(0, len(stream), chunk):
            receiver.feed(stream[start : start + chunk])
        receiver.close()
        return receiver
    finally:
        os.close(fd)


@pytest.mark.parametrize("chunk", [7, 4096, 1 << 22])
def test_a_sparse_file_arrives_whole_and_only_its_data_is_sent(tmp_path: Path, chunk: int) -> None:
    src = tmp_path / "ram"
    with open(src, "wb") as f:
        f.truncate(64 << 20)
        f.seek(1 << 20)
        f.write(os.urandom(3 << 20))  # more than a piece: split in records
        f.seek(20 << 20)
        f.write(bytes(256 << 10))  # written zeros: data on disk, not sent
        f.seek(30 << 20)
        f.write(b"x" * 5000)  # not block-aligned
        f.seek((64 << 20) - 10)
        f.write(b"the end..!")
    dest = tmp_path / "copy"
    got = received(src, dest, chunk)
    assert dest.read_bytes() == src.read_bytes()
    sent = sparse.data_bytes(src)
    assert (3 << 20) <= sent < (4 << 20)  # the random MiBs and two blocks, no zeros
    assert got.received < sent + 4096
    assert dest.stat().st_blocks * 512 < 8 << 20  # written sparse


def test_an_empty_file_and_a_file_of_zeros(tmp_path: Path) -> None:
    for size in (0, 1 << 20):
        src = tmp_path / f"z{size}"
        src.write_bytes(bytes(size))
        dest = tmp_path / f"z{size}.copy"
        received(src, dest, 1000)
        assert dest.stat().st_size == size and dest.read_bytes() == bytes(size)


def test_a_stream_that_lies_is_refused(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "out", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        header = sparse.MAGIC + (100).to_bytes(8, "little")
        past_end = (90).to_bytes(8, "little") + (20).to_bytes(8, "little")
        with pytest.raises(errors.CellaError, match="bad extent"):
            sparse.Receiver(fd).feed(header + past_end)
        with pytest.raises(errors.CellaError, match="no extent stream"):
            sparse.Receiver(fd).feed(b"HTTP/1.1 200 OK\r\n" + bytes(16))
        short = sparse.Receiver(fd)
        short.feed(header + (0).to_bytes(8, "little") + (10).to_bytes(8, "little") + b"abc")
        with pytest.raises(errors.CellaError, match="ended early"):
            short.close()
        backwards = sparse.Receiver(fd)
        one = (50).to_bytes(8, "little") + (10).to_bytes(8, "little") + bytes(10)
        two = (10).to_bytes(8, "little") + (10).to_bytes(8, "little")
        with pytest.raises(errors.CellaError, match="bad extent"):
            backwards.feed(header + one + two)
    finally:
        os.close(fd)
