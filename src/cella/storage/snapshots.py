"""Snapshot files on disk and their manifest.

A snapshot is a directory: `ram` (guest memory, mapped copy-on-write by every VM restored
from it, so unchanged pages are shared), `state` (device state), `disk.qcow2` (the frozen
disk; restores get an overlay on it) and `manifest.json` with a SHA-256 of each file.
A snapshot of a VM that was itself restored keeps its memory as a layer instead of `ram`:
`ram.base` (a hard link to the RAM file the VM was restored from, so it lives as long as
the layer does) and the pages written since (`ram.index`, `ram.layer`; see
`cella.runtime.qemu.ramdiff`), until it is flattened into a `ram` of its own.
A snapshot taken without memory holds only `disk.qcow2` (its manifest says `"memory":
false`); a sandbox made from it boots from that disk. Nothing is restored before its
files match the manifest. Hashing the RAM file takes a while,
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
from cella.storage.overlay import backing_file, flatten_image, image_info, rebase_unsafe

FILES = ("ram", "state", "disk.qcow2")
DISK_FILES = ("disk.qcow2",)  # a snapshot without memory
MEMORY_FILES = ("ram", "ram.index", "ram.layer")  # what a snapshot's memory takes
LAYERED_FILES = ("ram.base", "ram.index", "ram.layer", "state", "disk.qcow2")
SHARED = ("ram.base",)  # another snapshot's file: not counted as this one's, not re-moded
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

    @property
    def ram_base(self) -> Path:
        return self.path / "ram.base"

    def is_layered(self, manifest: dict[str, Any] | None = None) -> bool:
        return bool((manifest or self.manifest()).get("layered"))

    def has_memory(self, manifest: dict[str, Any] | None = None) -> bool:
        """Whether a VM can be restored from it (processes and all), or only booted from
        its disk."""
        return has_memory(manifest or self.manifest())

    def memory_bytes(self, manifest: dict[str, Any] | None = None) -> int | None:
        """The bytes its memory takes here (a layer's own pages only); None without memory."""
        manifest = manifest or self.manifest()
        if not has_memory(manifest):
            return None
        return sum(int(manifest["bytes"].get(name, 0)) for name in MEMORY_FILES)

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
        layered = self.ram_base.exists()
        memory = layered or self.ram.exists()
        names = LAYERED_FILES if layered else FILES if memory else DISK_FILES
        manifest = {
            **meta,
            "sha256": {name: sha256_of(self.path / name) for name in names},
            "bytes": {
                name: (self.path / name).stat().st_size for name in names if name not in SHARED
            },
        }
        if layered:
            manifest["layered"] = True
        if not memory:
            manifest["memory"] = False
        self._write_manifest(manifest)
        for name in names:
            if name not in SHARED:
                (self.path / name).chmod(0o400)  # read-only, and nobody else's to read
        return manifest

    def _write_manifest(self, manifest: dict[str, Any]) -> None:
        tmp = self.manifest_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True))
        tmp.rename(self.manifest_path)

    def files(self, manifest: dict[str, Any] | None = None) -> tuple[str, ...]:
        return files_of(manifest or self.manifest())

    def mark_flat(self) -> dict[str, Any]:
        """Once `ram` holds the base with the layer written over it: the manifest names
        `ram` instead of the layer, and the layer (and this link to the base) goes."""
        manifest = self.manifest()
        layer = [name for name in LAYERED_FILES if name not in FILES]
        for name in layer:
            manifest["sha256"].pop(name, None)
            manifest["bytes"].pop(name, None)
        manifest.pop("layered", None)
        manifest["sha256"]["ram"] = sha256_of(self.ram)
        manifest["bytes"]["ram"] = self.ram.stat().st_size
        self.ram.chmod(0o400)
        self._write_manifest(manifest)
        for name in layer:
            (self.path / name).unlink(missing_ok=True)
        return manifest

    def disk_backing(self) -> str | None:
        """The file the frozen disk sits on (a template's base, another snapshot's disk)."""
        return backing_file(self.disk)

    def disk_mib(self) -> int:
        """The frozen disk's size in MiB (what the guest sees)."""
        return int(str(image_info(self.disk)["virtual-size"])) >> 20

    def rebase_disk(self, base: Path) -> None:
        """Points the frozen disk at `base`, this node's copy of the file it sat on (the same
        content elsewhere), and records the disk's checksum again."""
        rebase_unsafe(self.disk, base)
        self.reseal(self.disk.name)

    def stand_alone(self) -> dict[str, Any]:
        """Makes the frozen disk one file of its own: what it sat on (a template's base, a
        warm snapshot's disk: files of this node's image cache) written into it, so a node
        that has only the snapshot's files boots it. Returns the manifest, resealed."""
        if self.disk_backing() is None:
            return self.manifest()
        flat = self.path / f"{self.disk.name}.flat"
        try:
            flatten_image(self.disk, flat)
            flat.chmod(0o400)
            flat.replace(self.disk)
        finally:
            flat.unlink(missing_ok=True)
        return self.reseal(self.disk.name)

    def reseal(self, name: str) -> dict[str, Any]:
        """Records a file's checksum (and size) again after a local, checked change (a disk
        rebased onto this node's copy of its backing file, or made to stand alone)."""
        manifest = self.manifest()
        manifest["sha256"][name] = sha256_of(self.path / name)
        if name not in SHARED:
            manifest["bytes"][name] = (self.path / name).stat().st_size
        self._write_manifest(manifest)
        return manifest

    def verify(self) -> dict[str, Any]:
        """Raises SnapshotCorrupt unless every file matches its checksum."""
        manifest = self.manifest()
        expected = manifest.get("sha256", {})
        for name in self.files(manifest):
            path = self.path / name
            if not path.exists():
                raise errors.SnapshotCorrupt(f"snapshot {self.path.name}: {name} is missing")
            if sha256_of(path) != expected.get(name):
                raise errors.SnapshotCorrupt(
                    f"snapshot {self.path.name}: {name} does not match its checksum"
                )
        return manifest


def has_memory(manifest: dict[str, Any]) -> bool:
    return manifest.get("memory", True) is not False


def files_of(manifest: dict[str, Any]) -> tuple[str, ...]:
    """The files a snapshot with this manifest holds."""
    if manifest.get("layered"):
        return LAYERED_FILES
    return FILES if has_memory(manifest) else DISK_FILES


def sha256_of(path: Path) -> str:
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
