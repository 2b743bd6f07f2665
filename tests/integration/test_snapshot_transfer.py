"""A snapshot taken on one node daemon forked on another: its files pulled node to node,
checked against the manifest, cached; the snapshots its disk sits on come with it."""

from __future__ import annotations

import os

import httpx2
import pytest

from tests.daemon import Daemon, DaemonFactory

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def nodes(module_daemon_factory: DaemonFactory) -> tuple[Daemon, Daemon]:
    a = module_daemon_factory("node-a", pool_size="0")
    b = module_daemon_factory("node-b", pool_size="0")
    return a, b


def take_in(dest: Daemon, source: Daemon, snapshot_id: str) -> httpx2.Response:
    return httpx2.post(
        f"{dest.url}/v1/snapshots/import",
        headers={"authorization": f"Bearer {dest.admin_key}"},
        json={"source_url": source.url, "source_key": source.admin_key, "snapshot_id": snapshot_id},
        timeout=120,
    )


def test_a_chain_of_snapshots_moves_and_forks_on_the_other_node(
    nodes: tuple[Daemon, Daemon],
) -> None:
    a, b = nodes
    with a.client() as ca, b.client() as cb:
        sb = ca.create()
        sb.files.write("/root/one", "first")
        first = sb.snapshot("first")
        [branch] = first.fork()
        branch.files.write("/root/two", "second")
        branch.exec("sh -c 'sleep 1000 >/dev/null 2>&1 &'")
        second = branch.snapshot("second")  # its disk is an overlay on first's

        assert cb.snapshots() == []
        answer = take_in(b, a, second.id)
        assert answer.status_code == 201, answer.text
        assert answer.json()["id"] == second.id
        assert {s.id for s in cb.snapshots()} == {first.id, second.id}

        [there] = cb.get_snapshot(second.id).fork()
        assert there.files.read("/root/one") == b"first"
        assert there.files.read("/root/two") == b"second"
        assert b"sleep 1000" in there.exec("ps -o args").stdout  # memory came too
        meta = b.data_dir / "snapshots" / second.id / "source.json"
        assert meta.exists()

        # taken in once: a second import pulls nothing and returns the same snapshot
        mtime = (b.data_dir / "snapshots" / second.id / "ram").stat().st_mtime_ns
        again = take_in(b, a, second.id)
        assert again.status_code == 201 and again.json()["id"] == second.id
        assert (b.data_dir / "snapshots" / second.id / "ram").stat().st_mtime_ns == mtime
        there.delete()
        branch.delete()
        sb.delete()


def test_a_file_that_does_not_match_its_manifest_is_refused(
    nodes: tuple[Daemon, Daemon],
) -> None:
    a, b = nodes
    with a.client() as ca, b.client() as cb:
        sb = ca.create()
        snap = sb.snapshot("tampered")
        sb.delete()
        state = a.data_dir / "snapshots" / snap.id / "state"
        state.chmod(0o600)
        with state.open("r+b") as f:  # a byte changed after the manifest was sealed
            f.seek(100)
            byte = f.read(1)
            f.seek(100)
            f.write(bytes([byte[0] ^ 0xFF]))
        answer = take_in(b, a, snap.id)
        assert answer.status_code == 409, answer.text
        assert answer.json()["error"]["code"] == "snapshot_corrupt"
        assert snap.id not in {s.id for s in cb.snapshots()}
        leftovers = [n for n in os.listdir(b.data_dir / "snapshots") if n.startswith(".")]
        assert leftovers == []


def test_only_admin_keys_move_snapshots(nodes: tuple[Daemon, Daemon]) -> None:
    """A tenant key can neither export a snapshot nor read its files: not another
    tenant's, not even its own. The control: the admin key gets both snapshots."""
    a, b = nodes
    with a.client() as ca:
        key = ca.create_key("someone")["key"]
        with ca.create() as sb:
            theirs = sb.snapshot("another tenant's").id
    with a.client(key) as tenant:
        with tenant.create() as sb:
            own = sb.snapshot("its own").id
        assert [s.id for s in tenant.snapshots()] == [own]  # whose is whose

    def get(path: str, key: str) -> httpx2.Response:
        headers = {"authorization": f"Bearer {key}", "range": "bytes=0-15"}
        return httpx2.get(f"{a.url}/v1/snapshots/{path}", headers=headers, timeout=60)

    try:
        for snap in (own, theirs):
            for path in (f"{snap}/export", f"{snap}/files/state", f"{snap}/files/ram"):
                refused = get(path, key)
                assert refused.status_code == 403, (path, refused.text)
                assert refused.json()["error"]["code"] == "permission_denied", refused.text
                allowed = get(path, a.admin_key)  # the control
                assert allowed.status_code in (200, 206), (path, allowed.text)
            assert get(f"{snap}/export", a.admin_key).json()["snapshot"]["id"] == snap
        assert len(get(f"{own}/files/state", a.admin_key).content) == 16
    finally:
        with a.client() as ca, a.client(key) as tenant:
            ca.get_snapshot(theirs).delete()
            tenant.get_snapshot(own).delete()
    bad = take_in(b, a, "../../etc")
    assert bad.status_code == 400
