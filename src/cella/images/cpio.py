"""A minimal writer for the `newc` cpio format the kernel unpacks as an initramfs."""

from __future__ import annotations

import stat
from dataclasses import dataclass
from typing import BinaryIO


@dataclass(frozen=True, slots=True)
class Member:
    name: str
    mode: int  # including the file type bits
    data: bytes = b""


def _pad(n: int) -> int:
    return (4 - n % 4) % 4


def write_newc(out: BinaryIO, members: list[Member]) -> None:
    """Writes members in order (parents before children), then the trailer."""
    for ino, m in enumerate([*members, Member("TRAILER!!!", 0)], start=1):
        name = m.name.encode() + b"\x00"
        nlink = 2 if stat.S_ISDIR(m.mode) else 1
        header = "070701" + "".join(
            f"{v:08x}" for v in (ino, m.mode, 0, 0, nlink, 0, len(m.data), 0, 0, 0, 0, len(name), 0)
        )
        out.write(header.encode() + name + b"\x00" * _pad(110 + len(name)))
        out.write(m.data + b"\x00" * _pad(len(m.data)))


def directory(name: str) -> Member:
    return Member(name, stat.S_IFDIR | 0o755)


def file(name: str, data: bytes, mode: int = 0o755) -> Member:
    return Member(name, stat.S_IFREG | mode, data)


def symlink(name: str, target: str) -> Member:
    return Member(name, stat.S_IFLNK | 0o777, target.encode())
