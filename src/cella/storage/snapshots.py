"""Snapshot files on disk and their manifest.

A snapshot is a directory: `ram` (guest memory, mapped copy-on-write by every VM restored
from it, so unchanged pages are shared), `state` (device state), `disk.qcow2` (the frozen
disk; restores get an overlay on it) and `manifest.json` with a SHA-256 of each file.
Nothing is restored before its files match the manifest. Hashing the RAM file takes a while,
so a verified file is remembered by (device, inode, size, mtime) and hashed again only when
those change.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cella import errors

FILES = ("ram", "state", "disk.qcow2")
_verified: dict[tuple[int, int, int, int], str] = {}
BLOCK = 64 << 10
_ZERO = bytes(BLOCK)


@dataclass(frozen=True, slots=True)
class SnapshotDir:
    path: Path

    @property
    def ram(self) -> Path:
        return self.path / "ram"

    @property
    def state(self) -> Path:
        return self.path / "state"

    @property
    def disk(self) -> Path:
        return self.path / "disk.qcow2"

    @property
    def manifest_path(self) -> Path:
        return self.path / "manifest.json"

    @property
    def source_path(self) -> Path:
        """How the snapshot's sandbox was made, kept with a snapshot taken in from another
        node (where that sandbox's row does not exist)."""
        return self.path / "source.json"

    def exists(self) -> bool:
        return self.manifest_path.exists()

    def manifest(self) -> dict[str, Any]:
        try:
            data: dict[str, Any] = json.loads(self.manifest_path.read_text())
        except (OSError, ValueError) as exc:
            raise errors.SnapshotCorrupt(
                f"snapshot {self.path.name}: bad manifest: {exc}"
            ) from None
        return data

    def seal(self, meta: dict[str, Any]) -> dict[str, Any]:
        """Hashes the files and writes the manifest last (its presence means complete)."""
        manifest = {
            **meta,
            "sha256": {name: _sha256(self.path / name) for name in FILES},
            "bytes": {name: (self.path / name).stat().st_size for name in FILES},
        }
        tmp = self.manifest_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True))
        tmp.rename(self.manifest_path)
        for name in FILES:
            (self.path / name).chmod(0o400)  # read-only, and nobody else's to read
        return manifest

    def reseal(self, name: str) -> None:
        """Records a file's checksum again after a local, checked change (a disk rebased
        onto this node's copy of its backing file)."""
        manifest = self.manifest()
        manifest["sha256"][name] = _sha256(self.path / name)
        self.manifest_path.write_text(json.dumps(manifest, indent=2, sort_keys=True))

    def verify(self) -> dict[str, Any]:
        """Raises SnapshotCorrupt unless every file matches its checksum."""
        manifest = self.manifest()
        expected = manifest.get("sha256", {})
        for name in FILES:
            path = self.path / name
            if not path.exists():
                raise errors.SnapshotCorrupt(f"snapshot {self.path.name}: {name} is missing")
            if _sha256(path) != expected.get(name):
                raise errors.SnapshotCorrupt(
                    f"snapshot {self.path.name}: {name} does not match its checksum"
                )
        return manifest


def _sha256(path: Path) -> str:
    """SHA-256 of the file's content, reading only where the file system says data lies.

    RAM files are mostly holes, so only data extents are read. The hash covers every
    non-zero 64 KiB block with its offset, and skips all-zero blocks, which read the same
    as holes: the extent map itself may not count. (It can change with no byte changing:
    an unwritten extent reads as a hole or as data depending on whether its zero pages sit
    in the page cache.)
    """
    st = os.stat(path)
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if key in _verified:
        return _verified[key]
    h = hashlib.sha256()
    h.update(f"size:{st.st_size}".encode())
    fd = os.open(path, os.O_RDONLY)
    next_block = 0  # blocks below this one are hashed already
    try:
        offset = 0
        while offset < st.st_size:
            try:
                start = os.lseek(fd, offset, os.SEEK_DATA)
            except OSError:  # no data after offset (ENXIO)
                break
            end = os.lseek(fd, start, os.SEEK_HOLE)
            block = max(next_block, start - start % BLOCK)
            while block < end:
                chunk = os.pread(fd, BLOCK, block)
                if chunk != _ZERO[: len(chunk)]:
                    h.update(f"@{block}:".encode())
                    h.update(chunk)
                block += BLOCK
            next_block = block
            offset = end
    finally:
        os.close(fd)
    digest = h.hexdigest()
    _verified[key] = digest
    return digest
