"""Fast starts, identity, pause, snapshots and forks on real microVMs behind a real daemon."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx2
import pytest

from cella import Client, Sandbox, errors
from tests.daemon import Daemon, DaemonFactory, SandboxFactory
from tests.vms import qemu_of

pytestmark = pytest.mark.vm

COUNTER = (
    "nohup sh -c 'i=0; while true; do i=$((i+1)); echo $i > /tmp/c; mv /tmp/c /tmp/count; "
    "sleep 0.05; done' "
    ">/dev/null 2>&1 &"
)


def counting(sb: object) -> bool:
    """The background counter started by COUNTER is alive in this sandbox (it moves on
    within a few seconds: a loaded host runs freshly restored branches slowly)."""
    deadline = time.monotonic() + 10
    # a snapshot may catch the counter before its first write; the copy makes it soon after
    while not sb.files.exists("/tmp/count"):  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, "the counter never wrote"
        time.sleep(0.1)
    first = int(sb.files.read("/tmp/count"))  # type: ignore[attr-defined]
    while time.monotonic() < deadline:
        time.sleep(0.2)
        if int(sb.files.read("/tmp/count")) > first:  # type: ignore[attr-defined]
            return True
    return False


def wait_pool_full(daemon: Daemon, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        health = httpx2.get(f"{daemon.url}/v1/health").json()
        if health["pool"] and all(n >= health["pool_size"] for n in health["pool"].values()):
            return
        time.sleep(0.1)
    raise AssertionError(f"pool never filled: {health}")


@pytest.fixture(scope="module")
def daemon_settings() -> dict[str, str]:
    return {"pool_size": "2"}


def test_create_claims_from_the_pool_with_a_fresh_identity(
    admin: Client, daemon: Daemon, sandbox_factory: SandboxFactory
) -> None:
    wait_pool_full(daemon)
    a, b = sandbox_factory(admin), sandbox_factory(admin)
    assert a.info.created_from == b.info.created_from == "pool"
    for sb in (a, b):
        # the pool fill named its VMs "pool": the names are the claim's
        r = sb.exec("hostname; echo $CELLA_SANDBOX_ID; cat /run/cella/sandbox-id; echo")
        hostname, env_id, file_id = r.text.split("\n")[:3]
        assert hostname == env_id == file_id == sb.id
    # the fill set a clock and a seed too, so from here a claim that set none would look
    # the same: tests/unit/test_service.py::test_a_pool_claim_and_a_fork_set_their_own_
    # clock_and_entropy pins that the claim (and a fork) sends its own


def test_empty_pool_falls_back_to_a_restore_not_a_boot(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory("nopool", pool_size="0")
    with d.client() as c:
        sb = c.create()
        assert sb.info.created_from == "restore"
        assert sb.exec("echo ok").stdout == b"ok\n"
        # a booted guest logs "ready" on its console; a restored one never boots
        console = (d.data_dir / "vms" / sb.id / "console.log").read_text()
        assert "cella-agent: ready" not in console
        kinds = {e.type: e.data for e in sb.events()}
        assert kinds["created"]["from"] == "restore"
        sb.delete()


def test_pause_keeps_processes_running_across_resume(admin: Client) -> None:
    with admin.create() as sb:
        sb.exec(COUNTER)
        assert counting(sb)
        before = int(sb.files.read("/tmp/count"))
        assert sb.pause().state == "paused"
        with pytest.raises(errors.InvalidState):
            sb.exec("true")
        time.sleep(1.0)  # paused for a while
        assert sb.resume().state == "running"
        assert int(sb.files.read("/tmp/count")) >= before  # not started again from 1
        assert counting(sb)  # the same process counts on


def test_fork_branches_are_isolated(admin: Client, sandbox_factory: SandboxFactory) -> None:
    parent = sandbox_factory(admin)
    parent.files.write("/workspace/shared.txt", "before the fork")
    parent.exec(COUNTER)
    branches = parent.fork(3)
    assert len(branches) == 3
    for br in branches:
        assert br.info.parent_id == parent.id and br.info.snapshot_id
        assert br.info.created_from == "fork"
        br.files.write("/workspace/mine.txt", br.id)
    parent.files.write("/workspace/parent-only.txt", "after")
    for br in branches:
        assert br.files.read("/workspace/shared.txt") == b"before the fork"
        assert br.files.read("/workspace/mine.txt") == br.id.encode()
        assert not br.files.exists("/workspace/parent-only.txt")
        assert counting(br)  # the parent's running process lives on in each branch
    assert not parent.files.exists("/workspace/mine.txt")
    names = [br.exec("hostname").text.strip() for br in branches]
    assert names == [br.id for br in branches]
    for br in branches:
        # where its restore's time went, step by step (its overlay a copy, no process)
        (forked,) = br.events(types=["forked"])
        steps = ("overlay", "qemu_start", "state_load", "first_answer", "vm", "ready")
        assert all(forked.data[f"{k}_ms"] >= 0 for k in steps), forked.data
        # QEMU started without a hook between fork and exec, yet without huge pages
        assert "THP_enabled:\t0" in thp_status(qemu_of(br.id))
        br.delete()
    assert "THP_enabled:\t1" in thp_status(1)  # the control: elsewhere the field reads 1


def thp_status(pid: int) -> str:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return next(line for line in lines if line.startswith("THP_enabled"))


# what a guest says of its identity: random bytes three ways, its boot, clock and names
IDENTITY = r"""
import json, os, socket, time
print(json.dumps({
    "getrandom": os.getrandom(32).hex(),
    "urandom": open("/dev/urandom", "rb").read(32).hex(),
    "uuid": open("/proc/sys/kernel/random/uuid").read().strip(),
    "boot_id": open("/proc/sys/kernel/random/boot_id").read().strip(),
    "time": time.time(),
    "hostname": socket.gethostname(),
    "env_id": os.environ.get("CELLA_SANDBOX_ID"),
    "file_id": open("/run/cella/sandbox-id").read().strip(),
}))
"""
RNDRESEEDCRNG = 0x5207  # _IO('R', 0x07)
LONG_AGO = 1_000_000_000  # 2001-09-09


def identity(sb: Sandbox) -> dict[str, Any]:
    before = time.time()
    r = sb.exec(["python3", "/tmp/identity.py"])
    assert r.exit_code == 0, r.stderr
    found: dict[str, Any] = json.loads(r.stdout)
    found["host_time"] = (before, time.time())
    return found


def test_sibling_forks_get_their_own_entropy_clock_and_names(admin: Client) -> None:
    """Two forks of one snapshot are copies of one running kernel (the boot id, made when
    the parent first read it, is the same), yet each draws its own random bytes, tells the
    time of now and has its own names. The parent's CRNG is reseeded and its clock set to
    2001 right before the snapshot: the kernel would not reseed a copy by itself for a
    while (the forks would draw the same bytes) and a copy that kept the snapshot's clock
    would say 2001."""
    with admin.create() as parent:
        parent.files.write("/tmp/identity.py", IDENTITY)
        booted = identity(parent)
        reseed = f"import fcntl; fcntl.ioctl(open('/dev/urandom', 'wb'), {RNDRESEEDCRNG})"
        ready = parent.exec(f'date -s @{LONG_AGO} >/dev/null && python3 -c "{reseed}"')
        assert ready.exit_code == 0, ready.stderr
        snap = parent.snapshot("identity")
        branches = snap.fork(2)
        try:
            seen = {sb.id: identity(sb) for sb in branches}  # first thing they run
            old = identity(parent)
            assert old["time"] < LONG_AGO + 600  # control: the snapshot's clock is 2001
            for sb_id, got in seen.items():
                assert got["hostname"] == got["env_id"] == got["file_id"] == sb_id, got
                before, after = got["host_time"]
                assert before - 5 < got["time"] < after + 5, (sb_id, got["time"], before)
            assert len(seen) == 2 and parent.id not in seen
            everyone = [*seen.values(), old]
            assert {g["boot_id"] for g in everyone} == {booted["boot_id"]}  # one boot, copied
            for source in ("getrandom", "urandom", "uuid"):
                drawn = [g[source] for g in everyone]
                assert len(set(drawn)) == len(drawn), (source, drawn)
        finally:
            for sb in branches:
                sb.delete()
            snap.delete()


def test_snapshot_refcounts_and_fork_from_snapshot(admin: Client, daemon: Daemon) -> None:
    parent = admin.create()
    parent.files.write("/workspace/state.txt", "v1")
    snap = parent.snapshot("v1")
    assert snap.info.state == "ready" and snap.info.paused_ms is not None
    parent.files.write("/workspace/state.txt", "v2")  # after the snapshot
    (child,) = snap.fork(1)
    assert child.files.read("/workspace/state.txt") == b"v1"
    assert parent.files.read("/workspace/state.txt") == b"v2"
    (grandchild,) = child.fork(1)  # a snapshot of the child, built on the first one
    assert grandchild.files.read("/workspace/state.txt") == b"v1"
    with pytest.raises(errors.InUse):
        snap.delete()  # the child's disk is built on it
    child.delete()
    with pytest.raises(errors.InUse):
        snap.delete()  # the snapshot taken for the grandchild is built on it
    grandchild.delete()
    (inner,) = [s for s in admin.snapshots() if s.info.sandbox_id == child.id]
    inner.delete()
    snap.delete()
    assert not (daemon.data_dir / "snapshots" / snap.id).exists()
    with pytest.raises(errors.NotFound):
        admin.get_snapshot(snap.id)
    parent.stop()  # the parent never depended on the snapshot
    parent.resume()
    assert parent.files.read("/workspace/state.txt") == b"v2"
    booted = parent.snapshot("after-resume")  # booted, not restored: its whole RAM saved
    (again,) = booted.fork(1)
    assert again.files.read("/workspace/state.txt") == b"v2"
    again.delete()
    parent.delete()
    booted.delete()


def test_corrupted_snapshot_is_refused(
    admin: Client, daemon: Daemon, sandbox_factory: SandboxFactory
) -> None:
    parent = sandbox_factory(admin)
    snap = parent.snapshot("to-corrupt")
    state = daemon.data_dir / "snapshots" / snap.id / "state"
    state.chmod(0o644)
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state.write_bytes(bytes(data))
    before = {s.id for s in admin.list()}
    with pytest.raises(errors.SnapshotCorrupt):
        snap.fork(1)
    assert {s.id for s in admin.list()} == before  # nothing was created
    assert parent.exec("echo fine").stdout == b"fine\n"


def test_memory_is_an_option_of_stop_snapshot_and_create(
    admin: Client, sandbox_factory: SandboxFactory
) -> None:
    """cella's own API: a stop that keeps memory is a pause, a snapshot may leave memory
    out, and a create from a snapshot restores its memory, insists on it, or boots."""
    sb = sandbox_factory(admin, stop_keeps_memory=True)
    assert sb.info.stop_keeps_memory
    sb.files.write("/workspace/note.txt", "kept")
    sb.exec(COUNTER)
    assert sb.stop().state == "paused"  # the sandbox's own choice
    assert sb.resume().state == "running" and counting(sb)  # the same counter runs on
    assert sb.stop(memory=False).state == "stopped"  # asked for per stop
    assert sb.resume().state == "running"
    assert sb.files.read("/workspace/note.txt") == b"kept" and not counter_runs(sb)
    sb.exec(COUNTER)
    assert counting(sb)
    disk = sb.snapshot("disk-only", memory=False)
    full = sb.snapshot("with-memory")
    assert (disk.info.memory, full.info.memory) == (False, True)
    booted = sandbox_factory(admin, snapshot=disk.id)
    assert booted.files.read("/workspace/note.txt") == b"kept" and not counter_runs(booted)
    never = sandbox_factory(admin, snapshot=full.id, restore_memory="never")
    assert never.files.read("/workspace/note.txt") == b"kept" and not counter_runs(never)
    with pytest.raises(errors.InvalidArgument, match="without memory"):
        admin.create(snapshot=disk.id, restore_memory="always")
    always = sandbox_factory(admin, snapshot=full.id, restore_memory="always")
    assert counter_runs(always) and counting(always)


def counter_runs(sb: Sandbox) -> bool:
    """Whether COUNTER's process is there (the brackets keep pgrep's own shell out)."""
    found = sb.exec("pgrep -f 'while [t]rue' >/dev/null && echo yes || echo no")
    return found.stdout == b"yes\n"
