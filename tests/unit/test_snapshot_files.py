import os
import subprocess
from pathlib import Path

import pytest

from cella import errors
from cella.storage import overlay, snapshots
from cella.storage.snapshots import SnapshotDir


def make(tmp_path: Path) -> SnapshotDir:
    snap = SnapshotDir(tmp_path / "s")
    snap.path.mkdir()
    with snap.ram.open("wb") as f:  # sparse, like a RAM file: data, a hole, data
        f.write(b"kernel")
        f.seek(8 << 20)
        f.write(b"page cache")
        f.truncate(16 << 20)
    snap.state.write_bytes(b"device state")
    snap.disk.write_bytes(b"qcow2")
    snap.seal({"vcpus": 1})
    return snap


def test_sealed_snapshot_verifies(tmp_path: Path) -> None:
    assert make(tmp_path).verify()["vcpus"] == 1


@pytest.mark.parametrize("name", ["ram", "state", "disk.qcow2"])
def test_any_changed_byte_is_refused(tmp_path: Path, name: str) -> None:
    snap = make(tmp_path)
    target = snap.path / name
    target.chmod(0o644)
    with target.open("r+b") as f:
        f.seek(0)
        f.write(b"X")
    snapshots._verified.clear()
    with pytest.raises(errors.SnapshotCorrupt, match=name):
        snap.verify()


def test_data_moved_into_a_hole_is_refused(tmp_path: Path) -> None:
    snap = make(tmp_path)
    snap.ram.chmod(0o644)
    with snap.ram.open("r+b") as f:  # same bytes, another place
        f.seek(4 << 20)
        f.write(b"kernel")
        f.seek(0)
        f.write(b"\0" * 6)
    snapshots._verified.clear()
    with pytest.raises(errors.SnapshotCorrupt):
        snap.verify()


def test_missing_file_and_manifest(tmp_path: Path) -> None:
    snap = make(tmp_path)
    os.unlink(snap.state)
    with pytest.raises(errors.SnapshotCorrupt, match="missing"):
        snap.verify()
    snap.manifest_path.write_text("{not json")
    with pytest.raises(errors.SnapshotCorrupt, match="manifest"):
        snap.verify()


def test_the_extent_map_does_not_count(tmp_path: Path) -> None:
    """Zeros written where a hole was (or the reverse) change no byte: still valid."""
    snap = make(tmp_path)
    snap.ram.chmod(0o644)
    with snap.ram.open("r+b") as f:
        f.seek(2 << 20)
        f.write(bytes(1 << 20))  # explicit zeros inside the hole
    snapshots._verified.clear()
    assert snap.verify()["vcpus"] == 1


def _qemu_io(image: Path, command: str) -> str:
    done = subprocess.run(
        ["qemu-io", "-f", "qcow2", "-c", command, str(image)],
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout + done.stderr


def test_a_disk_made_to_stand_alone_keeps_every_block_without_its_backing(
    tmp_path: Path,
) -> None:
    """What a snapshot built from an image does before it is ready: the blocks of the files
    under its disk (the template's base, the warm snapshot's disk) are written into it, so a
    node without those files reads the same disk. The control: before, the disk needs its
    base (gone, it cannot be read)."""
    base = tmp_path / "base.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(base), "8M"], check=True)
    assert "wrote" in _qemu_io(base, "write -P 0xab 0 64k")
    snap = SnapshotDir(tmp_path / "s")
    snap.path.mkdir()
    overlay.create_overlay(base, snap.disk)
    assert "wrote" in _qemu_io(snap.disk, "write -P 0xcd 1M 64k")
    before = snap.seal({"memory": False})
    assert snap.disk_backing() == str(base.resolve())

    manifest = snap.stand_alone()
    assert snap.disk_backing() is None and snap.disk_mib() == 8
    assert manifest["sha256"]["disk.qcow2"] != before["sha256"]["disk.qcow2"]
    assert manifest["bytes"]["disk.qcow2"] == snap.disk.stat().st_size
    assert snap.verify() == manifest
    assert snap.disk.stat().st_mode & 0o777 == 0o400
    assert sorted(p.name for p in snap.path.iterdir()) == ["disk.qcow2", "manifest.json"]
    base.unlink()
    assert "Pattern verification failed" not in _qemu_io(snap.disk, "read -P 0xab 0 64k")
    assert "read 65536/65536" in _qemu_io(snap.disk, "read -P 0xab 0 64k")
    assert "read 65536/65536" in _qemu_io(snap.disk, "read -P 0xcd 1M 64k")
    assert "read 65536/65536" in _qemu_io(snap.disk, "read -P 0 2M 64k")
    assert snap.stand_alone() == manifest  # nothing under it: nothing to do

    # the control: an overlay on a base that is gone cannot be read at all
    gone = tmp_path / "gone.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(gone), "8M"], check=True)
    other = tmp_path / "other.qcow2"
    overlay.create_overlay(gone, other)
    gone.unlink()
    assert "read 65536/65536" not in _qemu_io(other, "read -P 0 0 64k")


def test_overlays_after_the_first_of_a_base_are_copies_qemu_reads_alike(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fork of N makes N empty overlays on one disk: only the first runs `qemu-img`, the
    others are its bytes. Each reads its base and keeps its own writes; another size, or a
    base replaced under the same name, is made anew (the control: qemu-img refused)."""
    base = tmp_path / "base.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(base), "8M"], check=True)
    assert "wrote" in _qemu_io(base, "write -P 0xab 0 64k")
    first, second = tmp_path / "a.qcow2", tmp_path / "b.qcow2"
    overlay.create_overlay(base, first)

    def no_process(*args: object, **kwargs: object) -> None:
        raise AssertionError("qemu-img ran")

    with monkeypatch.context() as m:
        m.setattr(overlay.subprocess, "run", no_process)
        overlay.create_overlay(base, second)
        with pytest.raises(AssertionError, match="qemu-img ran"):  # another size
            overlay.create_overlay(base, tmp_path / "c.qcow2", 16)
    assert second.read_bytes() == first.read_bytes()
    check = subprocess.run(["qemu-img", "check", str(second)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert overlay.backing_file(second) == str(base.resolve())
    assert "wrote" in _qemu_io(second, "write -P 0xcd 1M 64k")
    assert "read 65536/65536" in _qemu_io(second, "read -P 0xab 0 64k")
    assert "read 65536/65536" in _qemu_io(second, "read -P 0xcd 1M 64k")
    assert "read 65536/65536" in _qemu_io(first, "read -P 0 1M 64k")  # not in its sibling

    base.unlink()  # a new base of another size under the same name
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(base), "16M"], check=True)
    third = tmp_path / "d.qcow2"
    overlay.create_overlay(base, third)
    assert overlay.image_info(third)["virtual-size"] == 16 << 20
