"""The jail's bookkeeping: ids that no two VMs on the host share, and the files below an
overlay that a jailed QEMU must be able to read."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from cella import errors
from cella.runtime.qemu import jail
from cella.runtime.qemu.jail import Jail, JailIds, backing_chain

IDS = JailIds(4_000_000, 3)


@pytest.fixture(autouse=True)
def private_dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jail, "ID_LOCKS", tmp_path / "ids")
    monkeypatch.setattr(jail, "JAIL_ROOT", tmp_path / "root")


def test_two_daemons_never_hand_out_the_same_id() -> None:
    one, two = Jail(Path("/j"), IDS, "tcg"), Jail(Path("/j"), IDS, "tcg")
    got = [one.acquire("a"), two.acquire("b"), one.acquire("c")]
    assert len(set(got)) == 3 and all(4_000_000 < uid <= 4_000_003 for uid in got)
    assert one.acquire("a") == got[0]  # the same VM keeps its id
    with pytest.raises(errors.CapacityExceeded):
        two.acquire("d")
    one.release("a")
    assert two.acquire("d") == got[0]  # freed, so it can be handed out again


def test_stale_ids_are_cleared_live_ones_kept(tmp_path: Path) -> None:
    locks = tmp_path / "ids"
    locks.mkdir()
    (locks / "4000001").write_text("999999999\n")  # its daemon is gone, no process runs
    (locks / "4000002").write_text("1\n")  # held by a live process
    Jail(Path("/j"), IDS, "tcg")
    assert sorted(p.name for p in locks.iterdir()) == ["4000002"]


def test_the_backing_chain_of_an_overlay(tmp_path: Path) -> None:
    base, mid, top = tmp_path / "base.qcow2", tmp_path / "sub" / "mid.qcow2", tmp_path / "top"
    mid.parent.mkdir()
    img = ["qemu-img", "create", "-q", "-f", "qcow2"]
    subprocess.run([*img, str(base), "1M"], check=True)
    subprocess.run([*img, "-b", str(base), "-F", "qcow2", str(mid)], check=True)
    subprocess.run([*img, "-b", "sub/mid.qcow2", "-F", "qcow2", str(top)], check=True)
    assert backing_chain(top) == [mid, base]  # relative names resolved where they are
    assert backing_chain(base) == []
    (tmp_path / "not-qcow2").write_bytes(b"x" * 100)
    assert backing_chain(tmp_path / "not-qcow2") == []
