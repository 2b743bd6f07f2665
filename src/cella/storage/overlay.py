"""Copy-on-write disks: each sandbox writes to its own qcow2 overlay on a read-only base."""

from __future__ import annotations

import json
import subprocess
from collections import OrderedDict
from pathlib import Path

from cella import errors

EMPTY_KEPT = 64  # empty overlays kept in memory, one per base and size (~200 KiB each)
_empty: OrderedDict[tuple[object, ...], bytes] = OrderedDict()


def create_overlay(base: Path, overlay: Path, size_mib: int | None = None) -> None:
    """A new overlay backed by `base`; unchanged blocks stay shared with it.

    An empty overlay holds nothing of its own (its header names the base and the size), so
    the first one of a base is made by `qemu-img create` and every later one is a copy of
    its bytes: a fork of N or a burst of creates runs no process per sandbox (one costs
    ~20 ms of a busy host's CPU, and the caller's thread waits for it)."""
    if not base.exists():
        raise errors.ImageMissing(f"base image {base} does not exist")
    resolved = base.resolve()
    st = resolved.stat()
    # the base as it is now: a file replaced under the same name gets its own
    key = (str(resolved), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, size_mib)
    image = _empty.get(key)
    if image is None:
        _qemu_img_create(resolved, overlay, size_mib)
        _empty[key] = overlay.read_bytes()
        while len(_empty) > EMPTY_KEPT:
            _empty.popitem(last=False)
        return
    _empty.move_to_end(key)
    try:
        with open(overlay, "wb") as f:
            f.write(image)
    except OSError:
        overlay.unlink(missing_ok=True)
        raise


def _qemu_img_create(base: Path, overlay: Path, size_mib: int | None) -> None:
    cmd = ["qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", str(base)]
    cmd.append(str(overlay))
    if size_mib is not None:
        cmd.append(f"{size_mib}M")
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        overlay.unlink(missing_ok=True)
        raise errors.CellaError(f"qemu-img create failed: {proc.stderr.strip()}")


def rebase_unsafe(overlay: Path, base: Path) -> None:
    """Points `overlay` at `base` without touching its data: `base` must hold exactly what
    the overlay's old backing file held (another node's copy of it)."""
    proc = subprocess.run(
        ["qemu-img", "rebase", "-u", "-F", "qcow2", "-b", str(base.resolve()), str(overlay)],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise errors.CellaError(f"qemu-img rebase failed: {proc.stderr.strip()}")


def flatten_image(image: Path, dest: Path) -> None:
    """`image` and every file under it in its backing chain written as one new qcow2
    (`dest`) with no backing file; unallocated and zero clusters stay unwritten."""
    proc = subprocess.run(
        ["qemu-img", "convert", "-U", "-O", "qcow2", str(image), str(dest)],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        dest.unlink(missing_ok=True)
        raise errors.CellaError(f"qemu-img convert failed: {proc.stderr.strip()}")


def overlay_bytes(directory: Path) -> int:
    """Host disk the overlays in `directory` take (allocated blocks, not their size)."""
    return sum(p.stat().st_blocks * 512 for p in directory.glob("*.qcow2"))


def backing_file(image: Path) -> str | None:
    found = image_info(image).get("backing-filename")
    return str(found) if found else None


def image_info(image: Path) -> dict[str, object]:
    proc = subprocess.run(
        ["qemu-img", "info", "-U", "--output=json", str(image)],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise errors.NotFound(f"{image}: {proc.stderr.strip()}")
    info: dict[str, object] = json.loads(proc.stdout)
    return info
