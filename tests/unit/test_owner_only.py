"""The start-up walk that takes group and other access off the data and image directories,
on real trees: what it tightens, what it never touches (links, build scratch, files that
refuse), and that a tree closed once is not walked again."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from cella.paths import owner_only

VM_GROUP = 4_242_424


def mode(path: Path) -> int:
    return path.lstat().st_mode & 0o7777


def loose_tree(root: Path) -> Path:
    """`root` as an older version left it: everything open to others."""
    root.mkdir(mode=0o755)
    root.chmod(0o755)
    (root / "vms" / "a").mkdir(parents=True)
    for d in (root / "vms", root / "vms" / "a"):
        d.chmod(0o755)
    (root / "vms" / "a" / "disk.qcow2").write_text("disk")
    (root / "vms" / "a" / "disk.qcow2").chmod(0o644)
    return root


@contextlib.contextmanager
def immutable(path: Path) -> Iterator[None]:
    """`path` refuses every change, root's included (as a mounted /proc does)."""
    subprocess.run(["chattr", "+i", str(path)], check=True)
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


def test_what_is_open_is_closed_and_the_vm_group_keeps_its_access(tmp_path: Path) -> None:
    root = loose_tree(tmp_path / "data")
    shared = root / "vms" / "a" / "ram"
    shared.write_text("shared with jailed QEMUs")
    os.chown(shared, -1, VM_GROUP)
    shared.chmod(0o644)
    assert owner_only(root, VM_GROUP) == 5
    assert mode(root) == mode(root / "vms") == mode(root / "vms" / "a") == 0o700
    assert mode(root / "vms" / "a" / "disk.qcow2") == 0o600
    assert mode(shared) == 0o640  # its group reads it, nobody else


def test_links_are_never_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    outside.chmod(0o755)
    (outside / "file").write_text("not the daemon's")
    (outside / "file").chmod(0o644)
    root = loose_tree(tmp_path / "data")
    (root / "to-file").symlink_to(outside / "file")
    (root / "to-dir").symlink_to(outside)
    owner_only(root)
    assert mode(outside) == 0o755 and mode(outside / "file") == 0o644
    assert (root / "to-dir").is_symlink()
    assert mode(root / "vms" / "a" / "disk.qcow2") == 0o600  # control: the walk ran


def test_build_scratch_is_closed_but_not_entered(tmp_path: Path) -> None:
    root = loose_tree(tmp_path / "images")
    chroot = root / "tmp" / "template-x-123" / "rootfs"
    chroot.mkdir(parents=True)
    for d in (root / "tmp", chroot.parent, chroot):
        d.chmod(0o755)
    (chroot / "etc").mkdir()
    (chroot / "etc").chmod(0o755)
    owner_only(root, skip={root / "tmp"})
    assert mode(root / "tmp") == 0o700  # nobody else reaches the build
    assert mode(chroot) == mode(chroot / "etc") == 0o755  # and the build's tree is its own


def test_an_entry_that_refuses_is_passed_over(tmp_path: Path) -> None:
    root = loose_tree(tmp_path / "data")
    stuck = root / "vms" / "stuck"
    stuck.write_text("x")
    stuck.chmod(0o644)
    with immutable(stuck):
        owner_only(root)
    assert mode(stuck) == 0o644
    assert mode(root / "vms" / "a" / "disk.qcow2") == 0o600  # the walk went on


def test_an_entry_that_vanishes_is_passed_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = loose_tree(tmp_path / "data")
    listdir = os.listdir

    def with_a_vanished_name(path: int | str) -> list[str]:
        return ["gone-meanwhile", *listdir(path)]  # listed, then removed before it is opened

    monkeypatch.setattr(os, "listdir", with_a_vanished_name)
    owner_only(root)
    assert mode(root / "vms" / "a" / "disk.qcow2") == 0o600


def test_a_tree_closed_once_is_not_walked_again(tmp_path: Path) -> None:
    root = loose_tree(tmp_path / "images")
    assert owner_only(root) > 0
    # made later under a closed directory: nobody else can reach it, so a start does not
    # pay for a walk of the whole cache to look at it
    later = root / "vms" / "a" / "later"
    later.write_text("x")
    later.chmod(0o644)
    assert owner_only(root) == 0
    assert mode(later) == 0o644
    assert mode(root) == 0o700
