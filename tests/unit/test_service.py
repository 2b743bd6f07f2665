"""The service's decisions, in process, against the fake runtime: the lifecycle state
machine, crash handling, admission, the reaper and recovery. (The same paths run on real
microVMs in tests/integration.)"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from cella import errors
from cella.config import DaemonSettings
from cella.models import ExecRequest, SandboxCreate, SandboxState
from cella.policy.access import Principal
from cella.service.daemon import Daemon
from cella.service.lifecycle import POOLED_SHAPE
from cella.service.reaper import due
from cella.service.recovery import plan
from cella.service.warm import Shape
from cella.storage.snapshots import SnapshotDir
from cella.store import SandboxRecord, Store
from tests.unit.fake_runtime import FakeDriver, FakeVM

T, U = Principal.service("t"), Principal.service("u")  # the owners of tenants t and u

S = SandboxState


@pytest.fixture
async def daemon(tmp_path: Path) -> AsyncIterator[Daemon]:
    settings = DaemonSettings(
        data_dir=tmp_path,
        image_dir=tmp_path / "images",
        pool_size=0,
        max_sandboxes_per_tenant=3,
        max_host_memory_mib=4096,
        max_host_vcpus=8,
    )
    d = Daemon(settings, Store(tmp_path / "cella.db"), FakeDriver(tmp_path))
    yield d
    await d.registry.detach_all()
    d.store.close()


def fake_vm(d: Daemon, sandbox_id: str) -> FakeVM:
    vm = d.registry.vm(sandbox_id)
    assert isinstance(vm, FakeVM)
    return vm


def types(d: Daemon, sandbox_id: str) -> list[str]:
    return [e.type for e in d.store.events(sandbox_id)]


async def test_create_stop_resume_pause_delete(daemon: Daemon) -> None:
    life = daemon.lifecycle
    row = await life.create(T, SandboxCreate(labels={"k": "v"}, max_pids=64))
    assert (row.state, row.accel, row.created_from) == (S.running, "tcg", "restore")
    vm = fake_vm(daemon, row.id)
    assert row.pid == vm.pid and vm.agent.identity["hostname"] == row.id
    assert vm.agent.identity["pids_max"] == 64

    stopped = await life.stop(T, row.id)
    assert (stopped.state, stopped.pid) == (S.stopped, None) and vm.stopped_cleanly
    assert daemon.registry.vm(row.id) is None
    assert (await life.stop(T, row.id)).state == S.stopped  # idempotent

    with pytest.raises(errors.InvalidState):
        await life.pause(T, row.id)  # only a running sandbox pauses

    resumed = await life.resume(T, row.id)
    assert resumed.state == S.running and fake_vm(daemon, row.id) is not vm
    paused = await life.pause(T, row.id)
    assert paused.state == S.paused and fake_vm(daemon, row.id).paused
    assert (await life.resume(T, row.id)).state == S.running

    await life.delete(T, row.id)
    assert daemon.store.get_sandbox(row.id).state == S.deleted  # type: ignore[union-attr]
    assert not daemon.registry.directory(row.id).exists()
    with pytest.raises(errors.NotFound):
        await life.resume(T, row.id)
    assert types(daemon, row.id) == [
        "created",
        "stopped",
        "resumed",
        "paused",
        "resumed",
        "deleted",
    ]


async def test_another_tenant_sees_nothing(daemon: Daemon) -> None:
    row = await daemon.lifecycle.create(T, SandboxCreate())
    other = Principal.service("other")
    for call in (daemon.lifecycle.stop, daemon.lifecycle.delete, daemon.usage.usage):
        with pytest.raises(errors.NotFound):
            await call(other, row.id)
    with pytest.raises(errors.NotFound):
        daemon.trace.events(other, row.id)
    assert daemon.registry.find(other) == []
    assert [r.id for r in daemon.registry.find(T)] == [row.id]  # the control


async def test_unknown_template_and_small_disk_are_refused(daemon: Daemon) -> None:
    with pytest.raises(errors.InvalidArgument, match="unknown template"):
        await daemon.lifecycle.create(T, SandboxCreate(template="nope"))
    with pytest.raises(errors.InvalidArgument, match="at least"):
        await daemon.lifecycle.create(T, SandboxCreate(disk_mib=1024))
    row = await daemon.lifecycle.create(T, SandboxCreate(disk_mib=4096))
    assert fake_vm(daemon, row.id).disk_mib == 4096


async def test_a_crashed_vm_stops_its_sandbox_with_the_reason(daemon: Daemon) -> None:
    row = await daemon.lifecycle.create(T, SandboxCreate())
    fake_vm(daemon, row.id).crash()
    for _ in range(100):
        if daemon.registry.row(row.id).state == S.stopped:
            break
        await asyncio.sleep(0.01)
    after = daemon.registry.row(row.id)
    assert after.state == S.stopped and "killed by the test" in (after.error or "")
    assert "crashed" in types(daemon, row.id)
    assert (await daemon.lifecycle.resume(T, row.id)).state == S.running


async def test_a_failed_create_marks_the_row_and_frees_the_vm(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    driver = daemon.driver
    assert isinstance(driver, FakeDriver)
    made = driver._vm

    def broken(*args: object) -> FakeVM:
        vm = made(*args)  # type: ignore[arg-type]
        vm.agent.fail_identity = errors.AgentUnavailable("guest went silent")
        return vm

    monkeypatch.setattr(driver, "_vm", broken)
    with pytest.raises(errors.AgentUnavailable):
        await daemon.lifecycle.create(T, SandboxCreate())
    [row] = daemon.store.list_sandboxes("t")
    assert row.state == S.error and "guest went silent" in (row.error or "")
    assert types(daemon, row.id) == ["create_failed"]
    assert not driver.vms[-1].running and not daemon.registry.directory(row.id).exists()


async def test_admission_quota_and_capacity(daemon: Daemon) -> None:
    life = daemon.lifecycle
    rows = await asyncio.gather(
        *(life.create(T, SandboxCreate()) for _ in range(5)), return_exceptions=True
    )
    refused = [r for r in rows if isinstance(r, BaseException)]
    assert len(refused) == 2 and all(isinstance(r, errors.QuotaExceeded) for r in refused)
    # another tenant is not held by t's quota, but by the host's RAM (4096, 1536 committed)
    await life.create(U, SandboxCreate(memory_mib=2048))
    cap = daemon.admission.capacity()
    assert (cap.memory_mib_committed, cap.memory_mib_free) == (3584, 512)
    assert (cap.vcpus_committed, cap.live_sandboxes) == (4, 4)
    with pytest.raises(errors.CapacityExceeded, match="MiB"):
        await life.create(U, SandboxCreate(memory_mib=1024))
    with pytest.raises(errors.CapacityExceeded, match="vCPUs"):
        await life.create(Principal.service("v"), SandboxCreate(vcpus=8, memory_mib=128))
    with pytest.raises(errors.InvalidArgument, match="at most"):
        await life.create(Principal.service("v"), SandboxCreate(memory_mib=20000))
    # a stopped sandbox commits nothing
    first = next(r for r in rows if not isinstance(r, BaseException))
    assert isinstance(first, SandboxRecord)
    await life.stop(T, first.id)
    await life.create(T, SandboxCreate(memory_mib=128))


async def test_fork_count_is_admitted_as_a_whole(daemon: Daemon) -> None:
    row = await daemon.lifecycle.create(T, SandboxCreate(labels={"a": "b"}))
    with pytest.raises(errors.QuotaExceeded):
        await daemon.forks.fork(T, row.id, 3)  # 1 + 3 > 3
    forks = await daemon.forks.fork(T, row.id, 2)
    assert [f.state for f in forks] == [S.running, S.running]
    assert all(f.parent_id == row.id and f.labels == {"a": "b"} for f in forks)
    assert daemon.store.snapshot_users(forks[0].snapshot_id or "")[0] == [f.id for f in forks]


async def test_a_layered_snapshot_is_flattened_in_the_background_and_before_bulk_forks(
    daemon: Daemon,
) -> None:
    driver = daemon.driver
    assert isinstance(driver, FakeDriver)
    driver.layers = True
    driver.flatten_gate = asyncio.Event()
    row = await daemon.lifecycle.create(T, SandboxCreate())
    snap = await daemon.snapshots.snapshot(T, row.id, "one")
    where = SnapshotDir(daemon.snapshots.root / snap.id)
    assert where.is_layered() and snap.state == "ready"
    await asyncio.sleep(0)
    assert driver.flattened == [snap.id]  # under way, held at the gate
    # a single branch does not wait: it restores from the layer
    [one] = await daemon.forks.fork_snapshot(T, snap.id, 1)
    assert one.state == S.running and where.is_layered()
    await daemon.lifecycle.delete(T, one.id)  # room for two under the quota of three
    # two branches wait for the flat file (the same flatten, not a second one)
    two = asyncio.create_task(daemon.forks.fork_snapshot(T, snap.id, 2))
    await asyncio.sleep(0.05)
    assert not two.done()
    driver.flatten_gate.set()
    assert [r.state for r in await two] == [S.running, S.running]
    assert not where.is_layered() and driver.flattened == [snap.id]
    assert daemon.snapshots.get("t", snap.id).size_bytes == sum(where.manifest()["bytes"].values())
    # a daemon that stops mid-flatten leaves a whole layer; the next one flattens it
    driver.flatten_gate = asyncio.Event()
    left = await daemon.snapshots.snapshot(T, row.id, "left")
    await asyncio.sleep(0)
    await daemon.snapshots.close()
    assert SnapshotDir(daemon.snapshots.root / left.id).is_layered()
    assert daemon.snapshots.flatten_left() == 1
    driver.flatten_gate.set()
    await daemon.snapshots.flat(left.id)
    assert not SnapshotDir(daemon.snapshots.root / left.id).is_layered()


async def test_exec_is_traced_and_its_kept_output_bounded(daemon: Daemon) -> None:
    row = await daemon.lifecycle.create(T, SandboxCreate())
    result = await daemon.exec.run(T, row.id, ExecRequest(command=["echo", "x" * 100]), keep=10)
    assert result.stdout == b"echo xxxxx" and result.stdout_truncated == 95
    [event] = daemon.store.events(row.id, types=["exec"])
    assert event.data["stdout_bytes"] == 105 and event.data["exit_code"] == 0
    assert event.data["output_tail"].endswith("x" * 100)
    assert not daemon.registry.is_busy(row.id)


def record(state: S, **fields: object) -> SandboxRecord:
    now = datetime.now(UTC)
    defaults: dict[str, object] = {
        "created_at": (now - timedelta(seconds=100)).isoformat(),
        "last_active_at": (now - timedelta(seconds=50)).isoformat(),
    }
    return SandboxRecord(
        id=f"sb-{state}-{len(fields)}",
        tenant="t",
        state=state,
        template="default",
        vcpus=1,
        memory_mib=512,
        **{**defaults, **fields},  # type: ignore[arg-type]
    )


def test_reaper_decisions() -> None:
    now = datetime.now(UTC).timestamp()
    idle = lambda _: False  # noqa: E731
    cases = [
        (record(S.running, ttl_seconds=90), ("ttl", "delete")),
        (record(S.running, ttl_seconds=200), None),
        (record(S.stopped, ttl_seconds=90, ttl_action="stop"), None),  # already stopped
        (record(S.stopped, ttl_seconds=90, ttl_action="delete"), ("ttl", "delete")),
        (record(S.paused, ttl_seconds=90, ttl_action="pause"), None),
        (record(S.running, idle_timeout_seconds=40, idle_action="pause"), ("idle", "pause")),
        (record(S.running, idle_timeout_seconds=60), None),
        (record(S.paused, idle_timeout_seconds=40), None),  # a paused sandbox is not idle
    ]
    for row, expected in cases:
        got = [(e.limit, e.action) for e in due([row], now, idle)]
        assert got == ([expected] if expected else []), row
    busy_row = record(S.running, idle_timeout_seconds=40)
    assert due([busy_row], now, lambda sid: sid == busy_row.id) == []  # an exec is running


async def test_reaper_enforces_a_ttl(daemon: Daemon) -> None:
    row = await daemon.lifecycle.create(T, SandboxCreate(ttl_seconds=60, ttl_action="stop"))
    past = (datetime.now(UTC) - timedelta(seconds=61)).isoformat()
    daemon.registry.update(row.id, created_at=past)
    await daemon.reaper.once()
    assert daemon.registry.row(row.id).state == S.stopped
    assert types(daemon, row.id)[-2:] == ["limit_hit", "stopped"]


def test_recovery_plans() -> None:
    assert plan(record(S.creating)) == "free"
    assert plan(record(S.deleting, pid=7)) == "free"
    assert plan(record(S.running, pid=7)) == "adopt"
    assert plan(record(S.paused, pid=7)) == "adopt"
    assert plan(record(S.running)) == "stop"  # no pid: nothing to adopt
    assert plan(record(S.stopping, pid=7)) == "stop"
    assert plan(record(S.stopped)) == "keep"
    assert plan(record(S.error)) == "keep"


async def test_recovery_acts_on_what_a_crashed_daemon_left(daemon: Daemon) -> None:
    driver = daemon.driver
    assert isinstance(driver, FakeDriver)
    vms = daemon.driver.paths.vms

    def left(sandbox_id: str, state: S, pid: int | None = None) -> None:
        (vms / sandbox_id).mkdir(parents=True)
        rec = record(state, pid=pid)
        rec.id = sandbox_id
        daemon.store.insert_sandbox(rec)
        daemon.store.update_sandbox(sandbox_id, state=state, pid=pid)

    left("sb-alive", S.running, 901)
    driver.orphans[901] = vms / "sb-alive"
    left("sb-frozen", S.paused, 902)
    driver.orphans[902] = vms / "sb-frozen"
    left("sb-gone", S.running, 903)  # its process died with the daemon
    left("sb-half", S.creating, 904)
    driver.orphans[904] = vms / "sb-half"
    left("sb-stopping", S.stopping, 905)
    driver.orphans[905] = vms / "sb-stopping"
    left("sb-off", S.stopped)
    driver.orphans[999] = vms / "sb-unknown"  # a QEMU nobody owns
    (vms / "sb-unknown").mkdir()

    counts = await daemon.recovery.recover()
    assert counts == {"adopted": 2, "stopped": 2, "cleaned": 1, "strays_killed": 1}
    state = {r.id: r.state for r in daemon.store.list_sandboxes()}
    assert state == {
        "sb-alive": S.running,
        "sb-frozen": S.paused,
        "sb-gone": S.stopped,
        "sb-half": S.error,
        "sb-stopping": S.stopped,
        "sb-off": S.stopped,
    }
    assert sorted(driver.killed) == [904, 905, 999]
    assert fake_vm(daemon, "sb-frozen").paused
    kept = {p.name for p in vms.iterdir()}
    assert kept == {"sb-alive", "sb-frozen", "sb-gone", "sb-stopping", "sb-off"}


async def test_a_guest_that_breaks_its_agent_is_marked_and_recovers(daemon: Daemon) -> None:
    row = await daemon.lifecycle.create(T, SandboxCreate())
    fake_vm(daemon, row.id).agent.break_protocol()
    for _ in range(100):
        if daemon.registry.row(row.id).error:
            break
        await asyncio.sleep(0.01)
    broken = daemon.registry.row(row.id)
    assert broken.state == S.running and "agent is unusable" in (broken.error or "")
    assert types(daemon, row.id)[-1] == "agent_broken"
    await daemon.lifecycle.stop(T, row.id)
    again = await daemon.lifecycle.resume(T, row.id)
    assert again.state == S.running and again.error is None
    result = await daemon.exec.run(T, row.id, ExecRequest(command=["true"]))
    assert result.exit_code == 0


async def test_resume_is_admitted_like_a_create(daemon: Daemon) -> None:
    life = daemon.lifecycle
    first = await life.create(T, SandboxCreate())
    for _ in range(2):
        await life.create(T, SandboxCreate())
    await life.stop(T, first.id)
    await life.create(T, SandboxCreate())  # quota 3: three running, one stopped
    with pytest.raises(errors.QuotaExceeded):
        await life.resume(T, first.id)
    assert daemon.registry.row(first.id).state == S.stopped  # refused, nothing changed


async def test_a_tenant_disk_quota_counts_stopped_sandboxes(daemon: Daemon) -> None:
    daemon.settings.max_disk_mib_per_tenant = 1
    life = daemon.lifecycle
    row = await life.create(T, SandboxCreate())
    disk = daemon.registry.directory(row.id) / "disk.qcow2"
    with disk.open("wb") as f:
        f.write(b"x" * (2 << 20))  # the sandbox wrote 2 MiB
    await life.stop(T, row.id)
    with pytest.raises(errors.QuotaExceeded, match="disk"):
        await life.create(T, SandboxCreate())
    with pytest.raises(errors.QuotaExceeded, match="disk"):
        await life.resume(T, row.id)
    await life.create(U, SandboxCreate())  # another tenant's disk is its own
    await life.delete(T, row.id)
    await life.create(T, SandboxCreate())


def test_a_stopped_sandbox_is_deleted_after_its_retention() -> None:
    now = datetime.now(UTC)
    stopped = record(
        S.stopped,
        delete_after_stop_seconds=60,
        stopped_at=(now - timedelta(seconds=61)).isoformat(),
    )
    fresh = record(
        S.stopped,
        delete_after_stop_seconds=600,
        stopped_at=(now - timedelta(seconds=61)).isoformat(),
    )
    # a stop that kept memory (a pause) counts; a pause that was no stop does not
    kept = record(
        S.paused, delete_after_stop_seconds=30, stopped_at=(now - timedelta(seconds=61)).isoformat()
    )
    paused = record(S.paused, delete_after_stop_seconds=20)
    got = [
        (e.sandbox.delete_after_stop_seconds, e.limit, e.action)
        for e in due([stopped, fresh, kept, paused], now.timestamp(), lambda _: False)
    ]
    assert got == [(60, "stopped", "delete"), (30, "stopped", "delete")]


async def test_names_are_unique_and_exec_defaults_apply(daemon: Daemon) -> None:
    from cella.models import ExecDefaults

    spec = SandboxCreate(name="box", exec_defaults=ExecDefaults(user="nobody", env={"A": "1"}))
    row = await daemon.lifecycle.create(T, spec)
    assert daemon.registry.named(T, "box").id == row.id
    with pytest.raises(errors.AlreadyExists):
        await daemon.lifecycle.create(T, SandboxCreate(name="box"))
    await daemon.lifecycle.create(U, SandboxCreate(name="box"))  # another tenant's name
    seen: list[dict[str, object]] = []
    agent = fake_vm(daemon, row.id).agent
    orig = agent.exec_stream

    async def spy(argv, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(kwargs)
        async for e in orig(argv, **kwargs):
            yield e

    agent.exec_stream = spy  # type: ignore[method-assign]
    await daemon.exec.run(T, row.id, ExecRequest(command="true", env={"B": "2"}))
    await daemon.exec.run(T, row.id, ExecRequest(command="true", user="root"))
    assert seen[0]["user"] == "nobody" and seen[0]["env"]["A"] == "1" and seen[0]["env"]["B"] == "2"
    assert seen[1]["user"] == "root"
    renamed = await daemon.lifecycle.update(T, row.id, name="box2", idle_timeout_seconds=60)
    assert renamed.name == "box2" and renamed.idle_timeout_seconds == 60
    stopped = await daemon.lifecycle.stop(T, row.id)
    assert stopped.stopped_at is not None
    assert (await daemon.lifecycle.resume(T, row.id)).stopped_at is None


async def test_a_pool_claim_and_a_fork_set_their_own_clock_and_entropy(tmp_path: Path) -> None:
    """The pool fill gave its VM a clock and a seed already; a claim must send its own (no
    test on real VMs can tell the two apart), and so must a fork."""
    settings = DaemonSettings(
        data_dir=tmp_path,
        image_dir=tmp_path / "images",
        pool_size=1,
        pool_spares=0,
        max_host_memory_mib=4096,
        max_host_vcpus=8,
    )
    driver = FakeDriver(tmp_path)
    d = Daemon(settings, Store(tmp_path / "cella.db"), driver)
    try:
        await d.pool.fill(Shape("default", *POOLED_SHAPE), timeout=10)
        (pooled,) = driver.vms
        filled = dict(pooled.agent.identity)
        assert filled["hostname"] == "pool" and filled["time_ns"] and filled["seed"]  # control
        claimed_at = time.time_ns()
        row = await d.lifecycle.create(T, SandboxCreate())
        assert row.created_from == "pool" and fake_vm(d, row.id) is pooled
        claimed = pooled.agent.identity  # the last call's fields only
        assert claimed["hostname"] == row.id
        assert claimed.get("time_ns", 0) >= claimed_at  # the claim's clock, not the fill's
        assert len(claimed.get("seed", b"")) >= 32 and claimed["seed"] != filled["seed"]
        (branch,) = await d.forks.fork(T, row.id, 1)
        forked = fake_vm(d, branch.id).agent.identity
        assert forked.get("time_ns", 0) >= claimed["time_ns"]
        assert len(forked.get("seed", b"")) >= 32 and forked["seed"] != claimed["seed"]
    finally:
        await d.pool.close()
        await d.registry.detach_all()
        d.store.close()


async def test_a_pooled_vm_found_unusable_is_replaced(tmp_path: Path) -> None:
    settings = DaemonSettings(
        data_dir=tmp_path,
        image_dir=tmp_path / "images",
        pool_size=1,
        pool_spares=0,
        max_host_memory_mib=4096,
        max_host_vcpus=8,
    )
    driver = FakeDriver(tmp_path)
    d = Daemon(settings, Store(tmp_path / "cella.db"), driver)
    shape = Shape("default", *POOLED_SHAPE)
    try:
        await d.pool.fill(shape, timeout=10)
        (pooled,) = driver.vms
        await pooled.kill()  # it died while waiting
        row = await d.lifecycle.create(T, SandboxCreate())
        assert row.created_from == "restore"  # not the dead one
        await d.pool.fill(shape, timeout=10)  # and the pool has a live one again
        assert d.pool.ready(shape) == 1
    finally:
        await d.pool.close()
        await d.registry.detach_all()
        d.store.close()


async def test_a_create_with_the_pool_empty_finishes_a_spare(tmp_path: Path) -> None:
    """A spare QEMU waits for the warm snapshot's state: the create only loads it, under
    the spare's name, and a new spare is started for the next create."""
    settings = DaemonSettings(
        data_dir=tmp_path,
        image_dir=tmp_path / "images",
        pool_size=0,
        pool_spares=1,
        max_host_memory_mib=4096,
        max_host_vcpus=8,
    )
    driver = FakeDriver(tmp_path)
    d = Daemon(settings, Store(tmp_path / "cella.db"), driver)
    shape = Shape("default", *POOLED_SHAPE)
    try:
        d.pool.watch(shape)
        async with asyncio.timeout(10):
            while not d.pool.spares()["default/1/512"]:
                await asyncio.sleep(0.01)
        (spare,) = [vm for vm in driver.vms if vm.spare_of is not None]
        assert d.pool.committed() == (0, 0)  # a spare holds no guest memory of its own
        row = await d.lifecycle.create(T, SandboxCreate())
        assert spare.directory is not None and row.id == spare.directory.name
        assert driver.spares_used == 1 and spare.spare_of is None
        assert d.store.events(row.id, 0, 10, ["created"])[0].data["spare"] is True
        async with asyncio.timeout(10):  # refilled after the create
            while not d.pool.spares()["default/1/512"]:
                await asyncio.sleep(0.01)
        await spare.kill()  # a spare found dead is not used: the create restores instead
        (second,) = [vm for vm in driver.vms if vm.spare_of is not None]
        await second.kill()
        other = await d.lifecycle.create(T, SandboxCreate())
        assert driver.spares_used == 1 and other.created_from == "restore"
        async with asyncio.timeout(10):  # and the dead ones are replaced
            while not d.pool.spares()["default/1/512"]:
                await asyncio.sleep(0.01)
    finally:
        await d.pool.close()
        await d.registry.detach_all()
        d.store.close()


async def test_a_stop_that_keeps_memory_pauses(daemon: Daemon) -> None:
    life = daemon.lifecycle
    row = await life.create(T, SandboxCreate(stop_keeps_memory=True))
    assert row.stop_keeps_memory and daemon.store.get_sandbox(row.id).stop_keeps_memory  # type: ignore[union-attr]
    vm = fake_vm(daemon, row.id)
    kept = await life.stop(T, row.id)
    assert kept.state == S.paused and vm.paused and not vm.stopped_cleanly
    assert kept.stopped_at is not None  # for its retention after a stop
    resumed = await life.resume(T, row.id)
    assert resumed.state == S.running and fake_vm(daemon, row.id) is vm
    assert resumed.stopped_at is None
    # asked for per stop, either way
    assert (await life.stop(T, row.id, memory=False)).state == S.stopped
    assert vm.stopped_cleanly
    await life.resume(T, row.id)
    plain = await life.create(T, SandboxCreate())
    assert (await life.stop(T, plain.id)).state == S.stopped
    await life.resume(T, plain.id)
    assert (await life.stop(T, plain.id, memory=True)).state == S.paused


async def test_a_snapshot_without_memory_is_booted_from(daemon: Daemon) -> None:
    driver = daemon.registry.driver
    assert isinstance(driver, FakeDriver)
    row = await daemon.lifecycle.create(T, SandboxCreate())
    disk = await daemon.snapshots.snapshot(T, row.id, "disk", memory=False)
    full = await daemon.snapshots.snapshot(T, row.id, "full")
    assert (disk.memory, full.memory) == (False, True)
    assert sorted(p.name for p in SnapshotDir(daemon.snapshots.root / disk.id).path.iterdir()) == [
        "disk.qcow2",
        "manifest.json",
    ]
    assert daemon.snapshots.memory_bytes(disk.id) is None
    assert daemon.snapshots.memory_bytes(full.id) == len(b"ram")  # the fake's RAM file

    await daemon.create(T, SandboxCreate(snapshot=disk.id))
    assert driver.cold_boots == 1
    await daemon.create(T, SandboxCreate(snapshot=full.id))  # if_present: restored
    assert driver.cold_boots == 1
    with pytest.raises(errors.InvalidArgument, match="without memory"):
        await daemon.create(T, SandboxCreate(snapshot=disk.id, restore_memory="always"))
    await daemon.lifecycle.delete(T, row.id)
    await daemon.create(T, SandboxCreate(snapshot=full.id, restore_memory="never"))
    assert driver.cold_boots == 2


async def test_a_pool_grows_to_a_burst_lends_its_extra_room_and_shrinks_back(
    tmp_path: Path,
) -> None:
    """A burst of creates: the pool keeps three ready afterwards (its max), the two
    beyond its size are not reported as committed (they give their room back), and with no
    burst for `pool_shrink_seconds` it is back to its size."""
    settings = DaemonSettings(
        data_dir=tmp_path,
        image_dir=tmp_path / "images",
        pool_size=1,
        pool_spares=0,
        pool_max_size=3,
        pool_shrink_seconds=1,
        max_host_memory_mib=8192,
        max_host_vcpus=8,
    )
    driver = FakeDriver(tmp_path)
    instant = driver.restore

    async def restore(*args: Any, **kwargs: Any) -> Any:  # takes a moment, as a real one
        await asyncio.sleep(0.05)
        return await instant(*args, **kwargs)

    driver.restore = restore  # type: ignore[method-assign]
    d = Daemon(settings, Store(tmp_path / "cella.db"), driver)
    shape = Shape("default", *POOLED_SHAPE)
    try:
        d.pool.watch(shape)
        async with asyncio.timeout(10):
            while d.pool.ready(shape) < 1:
                await asyncio.sleep(0.01)
        # four at once (the pooled one's create needs no restore: it is done first)
        rows = await asyncio.gather(*(d.lifecycle.create(T, SandboxCreate()) for _ in range(4)))
        async with asyncio.timeout(10):
            while d.pool.ready(shape) < 3:
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)
        assert d.pool.ready(shape) == 3  # its max
        assert d.pool.committed() == (3, 3 * 512)  # admission counts them all ...
        assert d.admission.capacity().memory_mib_committed == 4 * 512 + 512  # ... not lent
        for row in rows:
            await d.lifecycle.delete(T, row.id)
        async with asyncio.timeout(10):
            while d.pool.ready(shape) > 1:
                await asyncio.sleep(0.05)
        assert d.pool.ready(shape) == 1
    finally:
        await d.pool.close()
        await d.registry.detach_all()
        d.store.close()
