"""The screenshot's checks on the guest's bytes: a PNG's header, and its size from it."""

import struct
import zlib

from cella.service.desktop import PNG_SIGNATURE, png_size


def png(width: int, height: int) -> bytes:
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = struct.pack(">I", len(ihdr)) + b"IHDR" + ihdr
    return PNG_SIGNATURE + chunk + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))


def test_png_size_reads_the_header() -> None:
    assert png_size(png(1024, 768)) == (1024, 768)


def test_what_is_not_a_png_has_no_size() -> None:
    assert png_size(b"") is None
    assert png_size(PNG_SIGNATURE + b"\x00" * 16) is None  # no IHDR first
    assert png_size(png(0, 768)) is None
