"""Untrusted tar archives (an image's layers, an OCI archive), read in a child process.

A tar header declares how much the reader should take in (a pax record, a long name, a
sparse map), so a crafted one makes a reader allocate what it says; the child reads under
a memory bound and the daemon sees only its answer. Layers are counted before umoci unpacks
anything, stopping at the first limit passed; an OCI archive is unpacked to a layout of
regular files whose names are made here (never by skopeo's extraction, which follows links
the archive made).
"""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from cella import errors

MEMORY_BOUND = 1 << 30  # the child's address space
_LAYOUT_FILE = re.compile(r"(oci-layout|index\.json|blobs/sha256/[0-9a-f]{64})")


@dataclass(frozen=True, slots=True)
class Unpacked:
    """What layers unpack to: entries, bytes of file content (a sparse file's full size),
    and the limit passed first if any (`files` or `bytes`)."""

    files: int
    bytes: int
    over: str | None = None


def measure(blobs: list[Path], max_files: int, max_bytes: int) -> Unpacked:
    """Counts the layers `blobs` (tar, or gzip-compressed tar) in a child process."""
    out = _child("count", str(max_files), str(max_bytes), *map(str, blobs))
    return Unpacked(out["files"], out["bytes"], out.get("over"))


def unpack_archive(archive: Path, dest: Path, max_bytes: int) -> bool:
    """Unpacks an OCI archive into the new OCI layout `dest`: only `oci-layout`,
    `index.json` and `blobs/sha256/<digest>`, as regular files; anything else (a link, a
    device, another name) refuses the archive. False if it holds over `max_bytes`."""
    return not _child("unpack", str(archive), str(dest), str(max_bytes)).get("over")


def _child(*args: str) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "cella.images.layers", *args],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise errors.BuildFailed(f"reading the image's archives failed: {last}")
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


# -- in the child ----------------------------------------------------------------------------


def _count(blobs: list[str], max_files: int, max_bytes: int) -> dict[str, object]:
    files = size = 0
    for blob in blobs:
        with tarfile.open(blob, "r|*") as tar:
            for member in tar:  # a sparse file's size is its full size
                files += 1
                size += member.size if member.isreg() else 0
                over = "files" if files > max_files else "bytes" if size > max_bytes else None
                if over:
                    return {"files": files, "bytes": size, "over": over}
    return {"files": files, "bytes": size}


def _unpack(archive: str, dest: str, max_bytes: int) -> dict[str, object]:
    os.makedirs(os.path.join(dest, "blobs", "sha256"))
    total = 0
    with tarfile.open(archive, "r|*") as tar:
        for member in tar:
            name = os.path.normpath(member.name)
            if member.isdir() and name in (".", "blobs", "blobs/sha256"):
                continue  # made above
            if not (member.isreg() and _LAYOUT_FILE.fullmatch(name)):
                raise ValueError(f"{member.name!r} is not a file of an OCI layout")
            total += member.size
            if total > max_bytes:
                return {"over": True}
            source = tar.extractfile(member)
            assert source is not None
            _write_new(os.path.join(dest, name), source)
    return {}


def _write_new(path: str, source: IO[bytes]) -> None:
    # O_EXCL: a name the archive holds twice does not reopen (or follow) the first
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as out:
        while chunk := source.read(1 << 20):
            out.write(chunk)


def main(argv: list[str]) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BOUND, MEMORY_BOUND))
    command, *args = argv
    try:
        if command == "count":
            out = _count(args[2:], int(args[0]), int(args[1]))
        else:
            out = _unpack(args[0], args[1], int(args[2]))
    except (tarfile.TarError, ValueError, OSError, EOFError) as exc:
        sys.exit(f"{type(exc).__name__}: {exc}")
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
