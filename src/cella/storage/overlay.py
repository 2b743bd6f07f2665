"""Copy-on-write disks: each sandbox writes to its own qcow2 overlay on a read-only base."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from cella import errors


def create_overlay(base: Path, overlay: Path, size_mib: int | None = None) -> None:
    """A new overlay backed by `base`; unchanged blocks stay shared with it."""
    if not base.exists():
        raise errors.ImageMissing(f"base image {base} does not exist")
    cmd = [
        "qemu-img",
        "create",
        "-q",
        "-f",
        "qcow2",
        "-F",
        "qcow2",
        "-b",
        str(base.resolve()),
        str(overlay),
    ]
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
