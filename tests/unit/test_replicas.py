"""A fleet's replica, node side, on the fake runtime: a sandbox copied on its node (running,
paused and stopped; with memory or its disk alone), the copy shipped to another daemon in
process, and taken in there under the same id when the first is gone, paused when the
copy has memory (on real microVMs: tests/fleet/replica_checks.py)."""

from __future__ import annotations

from typing import Any

import pytest

from cella import errors
from cella.models import SandboxCreate, SandboxState
from cella.models.fleet import SandboxExport
from cella.service.daemon import Daemon
from tests.unit.fake_runtime import FakeVM
from tests.unit.test_moves import Local, T, nodes, vm_of  # noqa: F401  (the fixture)

S = SandboxState


async def ship(source: Daemon, dest: Daemon, export: SandboxExport) -> None:
    """What the gateway does with a copy: shipped, then gone from the sandbox's node."""
    local = Local(source)
    await dest.shipping.take_in(await local.export(export.snapshot_id), local.export, local.pull)
    await source.snapshots.delete("t", export.snapshot_id)


async def test_a_copy_taken_in_elsewhere_is_the_sandbox_again(
    nodes: tuple[Daemon, Daemon],  # noqa: F811
) -> None:
    a, b = nodes
    made = await a.lifecycle.create(T, SandboxCreate(name="kept", labels={"k": "v"}))
    a.registry._touched.pop(made.id, None)  # a touch now would be written
    before = a.store.get_sandbox(made.id).last_active_at
    running = await a.replicas.take(made.id)  # it runs on meanwhile
    assert a.store.get_sandbox(made.id).last_active_at == before  # not the tenant's use
    assert running.state == "stopped" and running.sandbox["id"] == made.id
    assert a.store.get_sandbox(made.id).state == S.running
    await ship(a, b, running)
    await a.lifecycle.stop(T, made.id)
    stopped = await a.replicas.take(made.id)  # the disk as the stop left it
    assert stopped.snapshot_id != running.snapshot_id and stopped.held_ms == 0
    assert a.store.get_sandbox(made.id).state == S.stopped
    await ship(a, b, stopped)
    assert a.store.get_snapshot(stopped.snapshot_id).state == "deleted"  # none left home

    with pytest.raises(errors.InvalidArgument):  # a copy of another sandbox is refused
        other = stopped.model_copy(update={"sandbox": {**stopped.sandbox, "id": "sb-other"}})
        await b.replicas.recover(other, {})
    back = await b.replicas.recover(stopped, {"from_node": "a", "replica_age_seconds": 3.0})
    assert back.id == made.id and back.state == S.stopped and back.pid is None
    assert back.name == "kept" and back.labels == {"k": "v"} and back.tenant == "t"
    said = [e.data for e in b.store.events(made.id) if e.type == "recovered"]
    assert said == [{"from_node": "a", "replica_age_seconds": 3.0, "state": "stopped"}]
    with pytest.raises(errors.Conflict):  # one copy per node
        await b.replicas.recover(stopped, {})
    resumed = await b.lifecycle.resume(T, made.id)
    assert resumed.state == S.running


async def test_a_paused_sandbox_is_copied_with_its_memory_and_comes_back_paused(
    nodes: tuple[Daemon, Daemon],  # noqa: F811
) -> None:
    """A paused sandbox's copy has its memory (its guest ran for the copy's sync and was
    frozen again; its row stayed paused); taken in elsewhere it is paused there, and a
    resume goes on with its VM. A running one's copy has memory only when asked for."""
    a, b = nodes
    made = await a.lifecycle.create(T, SandboxCreate(name="frozen"))
    events = len(a.store.events(made.id))
    await a.lifecycle.pause(T, made.id)
    seen: list[bool] = []
    snapshot_vm = a.driver.snapshot_vm

    async def watched(vm: FakeVM, *args: Any, **kwargs: Any) -> Any:
        seen.append(vm.paused)  # a real guest must run to sync its files
        return await snapshot_vm(vm, *args, **kwargs)

    a.driver.snapshot_vm = watched  # type: ignore[method-assign]
    copy = await a.replicas.take(made.id)
    assert seen == [False]
    assert copy.state == "paused" and copy.sandbox["state"] == "paused" and copy.held_ms == 0
    assert a.store.get_snapshot(copy.snapshot_id).memory
    assert a.store.get_sandbox(made.id).state == S.paused and vm_of(a, made.id).paused
    kinds = [e.type for e in a.store.events(made.id)[events:]]
    assert kinds == ["paused", "snapshot"]  # no resume of its own in its trace

    await ship(a, b, copy)
    back = await b.replicas.recover(copy, {"from_node": "a"})
    assert back.id == made.id and back.state == S.paused and vm_of(b, made.id).paused
    said = [e.data for e in b.store.events(made.id) if e.type == "recovered"]
    assert said == [{"from_node": "a", "state": "paused"}]
    resumed = await b.lifecycle.resume(T, made.id)
    assert resumed.state == S.running and not vm_of(b, made.id).paused

    # a running sandbox: its disk alone unless its memory is asked for (a live snapshot)
    await a.lifecycle.resume(T, made.id)
    disk = await a.replicas.take(made.id)
    live = await a.replicas.take(made.id, memory=True)
    assert disk.state == "stopped" and not a.store.get_snapshot(disk.snapshot_id).memory
    assert live.state == "paused" and a.store.get_snapshot(live.snapshot_id).memory
    assert live.held_ms > 0  # the running guest's pause for it
    assert a.store.get_sandbox(made.id).state == S.running and not vm_of(a, made.id).paused


async def test_a_failed_copy_of_a_paused_sandbox_leaves_it_paused(
    nodes: tuple[Daemon, Daemon],  # noqa: F811
) -> None:
    a, _ = nodes
    made = await a.lifecycle.create(T, SandboxCreate())
    await a.lifecycle.pause(T, made.id)

    async def broken(vm: FakeVM, *args: Any, **kwargs: Any) -> Any:
        raise errors.CellaError("the copy broke")

    a.driver.snapshot_vm = broken  # type: ignore[method-assign]
    with pytest.raises(errors.CellaError, match="broke"):
        await a.replicas.take(made.id)
    assert a.store.get_sandbox(made.id).state == S.paused and vm_of(a, made.id).paused


async def test_no_copy_of_a_sandbox_in_between_and_no_replica_on_one_daemon(
    nodes: tuple[Daemon, Daemon],  # noqa: F811
) -> None:
    a, _ = nodes
    made = await a.lifecycle.create(T, SandboxCreate())
    a.registry.update(made.id, state=S.stopping)  # neither running, paused nor stopped
    with pytest.raises(errors.InvalidState):
        await a.replicas.take(made.id)
    with pytest.raises(errors.NotFound):
        await a.replicas.take("sb-nope")
    with pytest.raises(errors.InvalidArgument, match="fleet"):
        a.replicas.refuse_here(SandboxCreate(replicate=True))
    with pytest.raises(errors.InvalidArgument, match="fleet"):
        a.replicas.refuse_here(SandboxCreate(replicate_memory=True))  # it is a replica too
    assert SandboxCreate(replicate_memory=True).replicate
    a.replicas.refuse_here(SandboxCreate())  # the control
    a.registry.update(made.id, state=S.running)
