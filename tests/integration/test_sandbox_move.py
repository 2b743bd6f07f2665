"""A sandbox moved from one node daemon to another under the same id (the node primitive a
fleet's move and drain use): frozen and snapshotted on the source, taken in on the
destination, its processes going on from where they were; a failed take-in leaves it
running on the source. A running sandbox's pre-copy sends the disk it wrote before the
freeze (the freeze ships what it wrote since), and a move that fails during it leaves the
sandbox running with its disk in one piece again."""

from __future__ import annotations

import time
from typing import Any

import httpx2
import pytest

from tests.daemon import Daemon, DaemonFactory

pytestmark = pytest.mark.vm

COUNTER = (
    "sh -c 'i=0; while :; do i=$((i+1)); echo $i > /run/counter; sleep 0.2; done' >/dev/null 2>&1 &"
)


@pytest.fixture(scope="module")
def nodes(module_daemon_factory: DaemonFactory) -> tuple[Daemon, Daemon]:
    a = module_daemon_factory("move-a", pool_size="0")
    b = module_daemon_factory("move-b", pool_size="0")
    return a, b


def post(node: Daemon, path: str, body: Any = None) -> httpx2.Response:
    return httpx2.post(
        f"{node.url}{path}",
        headers={"authorization": f"Bearer {node.admin_key}"},
        json=body,
        timeout=300,
    )


def move(source: Daemon, dest: Daemon, sandbox_id: str) -> dict[str, Any]:
    exported = post(source, f"/v1/sandboxes/{sandbox_id}/export")
    assert exported.status_code == 200, exported.text
    body = {"source_url": source.url, "source_key": source.admin_key, "export": exported.json()}
    taken = post(dest, "/v1/sandboxes/import", body)
    assert taken.status_code == 201, taken.text
    done = post(source, f"/v1/sandboxes/{sandbox_id}/export/finish?node=dest")
    assert done.status_code == 204, done.text
    answer: dict[str, Any] = taken.json()
    answer["export"] = exported.json()
    return answer


def exported_manifest(taken: dict[str, Any]) -> dict[str, Any]:
    """What the source said of the move's snapshot (its files' sizes, whether layered)."""
    manifest = taken["export"]["snapshot"]["manifest"]
    return {"bytes": manifest["bytes"], "layered": manifest.get("layered")}


def precopy(source: Daemon, dest: Daemon, sandbox_id: str) -> dict[str, Any]:
    """The pre-copy a fleet's gateway does before the export: the source's offer, pulled by
    the destination while the guest runs; returns what the destination says it pulled."""
    offer = post(source, f"/v1/sandboxes/{sandbox_id}/precopy")
    assert offer.status_code == 200, offer.text
    assert offer.json()["snapshot_id"], offer.text
    body = {"source_url": source.url, "source_key": source.admin_key, "offer": offer.json()}
    taken = post(dest, "/v1/sandboxes/precopy", body)
    assert taken.status_code == 201, taken.text
    answer: dict[str, Any] = taken.json()
    return answer


def delete_wherever(sandbox_id: str, *clients: Any) -> None:
    """The sandbox deleted on whichever node holds it (a move may have failed either way)."""
    for client in clients:
        if sandbox_id in {s.id for s in client.list()}:
            client.get(sandbox_id).delete()


def counter(sb: Any) -> int:
    return int(sb.exec("cat /run/counter").stdout)


def start_time(sb: Any) -> str:
    """The kernel's start time of the counting process (field 22 of /proc/PID/stat): the
    same value after a move means the same process, not a new one."""
    out = sb.exec("cut -d' ' -f22 /proc/$(cat /run/counter.pid)/stat")
    return str(out.stdout.decode().strip())


def test_a_running_sandbox_moves_with_its_memory_and_files(nodes: tuple[Daemon, Daemon]) -> None:
    a, b = nodes
    with a.client() as ca, b.client() as cb:
        sb = ca.create(name="mover", labels={"team": "x"})
        sb.exec(COUNTER)
        sb.files.write("/root/kept", "on disk")
        time.sleep(1)
        before = counter(sb)
        started = start_time(sb)
        assert before > 0
        taken = move(a, b, sb.id)
        assert taken["sandbox"]["id"] == sb.id and taken["sandbox"]["state"] == "running"
        there = cb.get(sb.id)
        assert there.state == "running" and there.info.name == "mover"
        assert there.info.labels == {"team": "x"}
        assert there.files.read("/root/kept") == b"on disk"
        after = counter(there)
        assert after >= before  # counted on from where it was, not from 1
        time.sleep(1)
        assert counter(there) > after  # and still counting
        assert start_time(there) == started  # the same process
        gone = httpx2.get(
            f"{a.url}/v1/sandboxes/{sb.id}",
            headers={"authorization": f"Bearer {a.admin_key}"},
            timeout=30,
        )
        assert gone.status_code == 404 or gone.json()["state"] == "deleted"
        # a stopped one: its disk moves, and it boots there with its files
        there.stop()
        back = move(b, a, sb.id)
        assert back["sandbox"]["state"] == "stopped"
        home = ca.get(sb.id)
        assert home.state == "stopped"
        home.resume()
        assert home.files.read("/root/kept") == b"on disk"
        home.delete()


def test_a_failed_take_in_leaves_it_running_where_it_was(nodes: tuple[Daemon, Daemon]) -> None:
    a, b = nodes
    with a.client() as ca:
        sb = ca.create()
        sb.exec(COUNTER)
        time.sleep(0.6)
        exported = post(a, f"/v1/sandboxes/{sb.id}/export")
        assert exported.status_code == 200, exported.text
        assert ca.get(sb.id).state == "paused"  # frozen while it travels
        body = {"source_url": a.url, "source_key": "not-the-key", "export": exported.json()}
        refused = post(b, "/v1/sandboxes/import", body)
        assert refused.status_code >= 400, refused.text
        aborted = post(a, f"/v1/sandboxes/{sb.id}/export/abort?reason=refused")
        assert aborted.status_code == 204, aborted.text
        assert ca.get(sb.id).state == "running"
        first = counter(sb)
        time.sleep(0.6)
        assert counter(sb) > first  # running on, here
        with b.client() as cb:  # (the control, the right key taken in: the test above)
            assert sb.id not in {s.id for s in cb.list()}
        sb.delete()


BIG = 50 << 20
# written past the guest's page cache (O_DIRECT): on its disk, not in its memory, so what
# the freeze ships of its RAM stays small and the disk's share is what the numbers show
WRITE_BIG = "dd if=/dev/urandom of=/root/big bs=1M count=50 oflag=direct status=none"
READ_BIG = "dd if=/root/big bs=1M iflag=direct status=none | md5sum"  # read past it too


def test_a_move_sends_the_disk_written_before_the_freeze_ahead(
    nodes: tuple[Daemon, Daemon],
) -> None:
    a, b = nodes
    with a.client() as ca, b.client() as cb:
        sb = ca.create()
        try:
            sb.exec(WRITE_BIG)
            digest = sb.exec(READ_BIG).stdout
            sb.exec(COUNTER.replace("sh -c '", "sh -c 'echo $$ > /run/counter.pid; "))
            time.sleep(0.6)
            started, before = start_time(sb), counter(sb)

            ahead = precopy(a, b, sb.id)
            assert ahead["bytes"] >= BIG  # the 50 MiB went before the freeze
            # written after the split: into the new overlay, which the freeze ships
            sb.files.write("/root/after", "written while the disk was split")
            taken = move(a, b, sb.id)
            assert taken["sandbox"]["state"] == "running"
            # what the freeze shipped: the RAM the guest wrote, its devices, the new overlay
            manifest = exported_manifest(taken)
            assert 0 < taken["bytes"] < BIG // 3, (taken["bytes"], manifest)

            there = cb.get(sb.id)
            assert there.exec(READ_BIG).stdout == digest
            assert there.files.read("/root/after") == b"written while the disk was split"
            assert start_time(there) == started and counter(there) >= before
            # the disk alone holds both (booted from it, not restored)
            there.stop()
            there.resume()
            assert there.exec(READ_BIG).stdout == digest
            assert there.files.read("/root/after") == b"written while the disk was split"
        finally:
            delete_wherever(sb.id, ca, cb)


def test_a_move_that_fails_during_its_precopy_leaves_it_running_whole(
    nodes: tuple[Daemon, Daemon],
) -> None:
    a, b = nodes
    with a.client() as ca, b.client() as cb:
        sb = ca.create()
        try:
            sb.files.write("/root/before", "before the split")
            offer = post(a, f"/v1/sandboxes/{sb.id}/precopy")
            assert offer.status_code == 200 and offer.json()["snapshot_id"], offer.text
            vm_dir = a.data_dir / "vms" / sb.id
            assert (vm_dir / "disk.top.qcow2").exists()  # split: the guest writes on top
            assert ca.get(sb.id).state == "running"  # and runs meanwhile
            sb.files.write("/root/during", "while split")

            body = {"source_url": a.url, "source_key": "not-the-key", "offer": offer.json()}
            refused = post(b, "/v1/sandboxes/precopy", body)
            assert refused.status_code >= 400, refused.text
            aborted = post(a, f"/v1/sandboxes/{sb.id}/export/abort?reason=refused")
            assert aborted.status_code == 204, aborted.text
            dropped = httpx2.delete(
                f"{b.url}/v1/sandboxes/{sb.id}/precopy/staged",
                headers={"authorization": f"Bearer {b.admin_key}"},
                timeout=30,
            )
            assert dropped.status_code == 204, dropped.text

            # running on here, its disk one file again, the pre-copy's snapshot gone
            assert ca.get(sb.id).state == "running"
            assert not (vm_dir / "disk.top.qcow2").exists()
            assert not [s for s in ca.snapshots() if sb.id in s.info.name]
            sb.files.write("/root/after", "after the merge")
            # the merged disk alone holds all three (booted from it, not restored)
            sb.stop()
            sb.resume()
            for name, text in (("before", "before the split"), ("during", "while split")):
                assert sb.files.read(f"/root/{name}") == text.encode()
            assert sb.files.read("/root/after") == b"after the merge"
            assert sb.id not in {s.id for s in cb.list()}
            # the control: the same pre-copy with the right key moves it
            precopy(a, b, sb.id)
            move(a, b, sb.id)
            assert cb.get(sb.id).files.read("/root/during") == b"while split"
        finally:
            delete_wherever(sb.id, ca, cb)
