"""The host-side diff of two ext4 disks (`storage.fsdiff`) on real qcow2 files made here:
a tree built by `mke2fs -d`, then changed through `debugfs -w` on an overlay, read back
through qemu-storage-daemon's FUSE export; and the patch it makes, applied by `git apply`."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from cella.models.checkpoints import CheckpointDiff, FileChange
from cella.storage import fsdiff

pytestmark = pytest.mark.skipif(
    not all(shutil.which(t) for t in ("mke2fs", "debugfs", "qemu-storage-daemon", "qemu-img")),
    reason="needs e2fsprogs and QEMU's tools",
)


def run(*argv: str | Path, cwd: Path | None = None) -> None:
    subprocess.run([str(a) for a in argv], check=True, capture_output=True, cwd=cwd)


def changed_copy(base: Path, dest: Path, commands: list[str], tmp: Path) -> None:
    """`dest`: an overlay over `base` with `commands` run by `debugfs -w` on it."""
    run("qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", base, dest)
    raw = tmp / "rw"
    raw.touch()
    qsd = subprocess.Popen(
        [
            "qemu-storage-daemon",
            "--blockdev", f"driver=file,node-name=f,filename={dest}",
            "--blockdev", "driver=qcow2,node-name=q,file=f",
            "--export", f"type=fuse,id=e,node-name=q,mountpoint={raw},writable=on",
        ]
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 10
        while raw.stat().st_size == 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        (tmp / "cmds").write_text("\n".join(commands) + "\n")
        run("debugfs", "-w", "-f", tmp / "cmds", raw)
    finally:
        qsd.terminate()
        qsd.wait()


@pytest.fixture
def disks(tmp_path: Path) -> tuple[Path, Path, Path]:
    src = tmp_path / "src"
    (src / "repo" / "sub").mkdir(parents=True)
    (src / "repo" / "a.txt").write_text("one\ntwo\nthree\n")
    (src / "repo" / "gone.txt").write_text("bye\n")
    (src / "repo" / "sub" / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (src / "repo" / "same.txt").write_text("same\n")
    (src / "repo" / "blob").write_bytes(bytes(range(256)))
    (src / "repo" / "tail.txt").write_text("no newline")
    raw = tmp_path / "a.raw"
    run("mke2fs", "-q", "-t", "ext4", "-d", src, raw, "32M")
    a = tmp_path / "a.qcow2"
    run("qemu-img", "convert", "-q", "-O", "qcow2", raw, a)
    (tmp_path / "new-a.txt").write_text("one\nTWO\nthree\nfour\n")
    (tmp_path / "new.py").write_text("print('new')\n")
    (tmp_path / "tail.txt").write_text("no newline, still")
    (tmp_path / "blob").write_bytes(bytes(range(255, -1, -1)) * 2)  # debugfs keeps times
    b = tmp_path / "b.qcow2"
    changed_copy(
        a,
        b,
        [
            "rm /repo/a.txt",
            f"write {tmp_path / 'new-a.txt'} /repo/a.txt",
            "rm /repo/gone.txt",
            "mkdir /repo/new",
            f"write {tmp_path / 'new.py'} /repo/new/new.py",
            "sif /repo/sub/run.sh mode 0100755",
            "rm /repo/tail.txt",
            f"write {tmp_path / 'tail.txt'} /repo/tail.txt",
            "rm /repo/blob",
            f"write {tmp_path / 'blob'} /repo/blob",
        ],
        tmp_path,
    )
    return src, a, b


def test_the_diff_names_every_change_with_sizes_modes_and_text(
    disks: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    _, a, b = disks
    changes, truncated = asyncio.run(fsdiff.diff_disks(a, b, tmp_path / "work"))
    assert not truncated
    got = {c.path: c for c in changes}
    assert {p: c.change for p, c in got.items()} == {
        "/repo/a.txt": "modified",
        "/repo/gone.txt": "removed",
        "/repo/new": "added",
        "/repo/new/new.py": "added",
        "/repo/sub/run.sh": "modified",
        "/repo/tail.txt": "modified",
        "/repo/blob": "modified",
    }
    assert (got["/repo/a.txt"].old_size, got["/repo/a.txt"].size) == (14, 19)
    assert got["/repo/a.txt"].diff is not None and "-two\n+TWO\n" in got["/repo/a.txt"].diff
    assert got["/repo/sub/run.sh"].mode == 0o755 and got["/repo/sub/run.sh"].diff is None
    assert got["/repo/blob"].binary and got["/repo/new"].kind == "dir"
    assert not (tmp_path / "work").exists()  # the views are gone


def test_the_patch_applies_with_git(disks: tuple[Path, Path, Path], tmp_path: Path) -> None:
    src, a, b = disks
    changes, _ = asyncio.run(fsdiff.diff_disks(a, b, tmp_path / "work"))
    diff = CheckpointDiff(
        sandbox_id="sb",
        a="a",
        b="b",
        changes=[FileChange.model_validate(_fields(c)) for c in changes],
    )
    checkout = tmp_path / "checkout"
    shutil.copytree(src / "repo", checkout)
    run("git", "init", "-q", checkout)
    patch = tmp_path / "p.patch"
    patch.write_text(diff.patch("/repo"))
    run("git", "apply", patch, cwd=checkout)
    assert (checkout / "a.txt").read_text() == "one\nTWO\nthree\nfour\n"
    assert (checkout / "new" / "new.py").read_text() == "print('new')\n"
    assert (checkout / "tail.txt").read_text() == "no newline, still"
    assert not (checkout / "gone.txt").exists()
    # only what is under the prefix, relative to it
    assert diff.patch("/elsewhere") == ""
    assert "a/repo/a.txt" in diff.patch("/")


def _fields(c: fsdiff.Change) -> dict[str, object]:
    return {k: getattr(c, k) for k in fsdiff.Change.__slots__}  # type: ignore[attr-defined]
