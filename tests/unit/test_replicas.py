"""A fleet's replica, node side, on the fake runtime: a sandbox copied on its node (running
and stopped), the copy shipped to another daemon in process, and taken in there under the
same id when the first is gone (on real microVMs: tests/fleet/replica_checks.py)."""

from __future__ import annotations

import pytest

from cella import errors
from cella.models import SandboxCreate, SandboxState
from cella.models.fleet import SandboxExport
from cella.service.daemon import Daemon
from tests.unit.test_moves import Local, T, nodes  # noqa: F401  (the fixture)

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
    assert said == [{"from_node": "a", "replica_age_seconds": 3.0}]
    with pytest.raises(errors.Conflict):  # one copy per node
        await b.replicas.recover(stopped, {})
    resumed = await b.lifecycle.resume(T, made.id)
    assert resumed.state == S.running


async def test_no_copy_of_a_paused_sandbox_and_no_replica_on_one_daemon(
    nodes: tuple[Daemon, Daemon],  # noqa: F811
) -> None:
    a, _ = nodes
    made = await a.lifecycle.create(T, SandboxCreate())
    await a.lifecycle.pause(T, made.id)
    with pytest.raises(errors.InvalidState):
        await a.replicas.take(made.id)
    with pytest.raises(errors.NotFound):
        await a.replicas.take("sb-nope")
    with pytest.raises(errors.InvalidArgument, match="fleet"):
        a.replicas.refuse_here(SandboxCreate(replicate=True))
    a.replicas.refuse_here(SandboxCreate())  # the control
