import os
from pathlib import Path

import pytest

from cella import errors
from cella.storage import snapshots
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
