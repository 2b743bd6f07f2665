"""A sandbox moved between two daemons in process, on the fake runtime (the node primitive
under a fleet's move and drain; on real microVMs: tests/integration/test_sandbox_move.py
and tests/fleet/move_checks.py)."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from cella import errors
from cella.config import DaemonSettings
from cella.models import SandboxCreate, SandboxState
from cella.models.fleet import SandboxExport, SandboxImport, SnapshotExport
from cella.models.volumes import VolumeMount
from cella.policy.access import Principal
from cella.service.daemon import Daemon
from cella.service.remote_volumes import RemoteVolume
from cella.store import Store
from tests.unit.fake_runtime import FakeDriver, FakeVM

T = Principal.service("t")
S = SandboxState


def daemon_at(root: Path) -> Daemon:
    root.mkdir()
    settings = DaemonSettings(data_dir=root, image_dir=root / "images", pool_size=0)
    return Daemon(settings, Store(root / "cella.db"), FakeDriver(root))


@pytest.fixture
async def nodes(tmp_path: Path) -> AsyncIterator[tuple[Daemon, Daemon]]:
    a, b = daemon_at(tmp_path / "a"), daemon_at(tmp_path / "b")
    yield a, b
    for d in (a, b):
        await d.registry.detach_all()
        d.store.close()


class Local:
    """A node's snapshots read in this process (what `NodeSource` does over HTTPS)."""

    def __init__(self, node: Daemon) -> None:
        self.node = node

    async def export(self, snapshot_id: str) -> SnapshotExport:
        return await self.node.shipping.export(snapshot_id)

    async def pull(self, snapshot_id: str, name: str, dest: Path) -> None:
        shutil.copyfile(self.node.shipping.file(snapshot_id, name), dest)


def importing(export: SandboxExport) -> SandboxImport:
    return SandboxImport(source_url="http://source", source_key="k", export=export)


def vm_of(d: Daemon, sandbox_id: str) -> FakeVM:
    vm = d.registry.vm(sandbox_id)
    assert isinstance(vm, FakeVM)
    return vm


async def test_a_running_sandbox_moves_and_a_stopped_one_moves_back(
    nodes: tuple[Daemon, Daemon],
) -> None:
    a, b = nodes
    made = await a.lifecycle.create(T, SandboxCreate(name="mover", labels={"k": "v"}))
    export = await a.moves.export(made.id)
    assert export.state == "running" and export.bytes > 0
    assert a.store.get_sandbox(made.id).state == S.paused  # frozen while it travels
    assert vm_of(a, made.id).paused
    with pytest.raises(errors.InvalidState):  # once at a time
        await a.moves.export(made.id)

    taken = await b.moves.take_in(importing(export), Local(a))
    assert taken.sandbox["id"] == made.id
    there = b.store.get_sandbox(made.id)
    assert there.state == S.running and there.name == "mover" and there.labels == {"k": "v"}
    assert there.created_at == made.created_at and there.tenant == "t"
    assert not vm_of(b, made.id).paused
    with pytest.raises(errors.Conflict):  # one copy per node
        await b.moves.take_in(importing(export), Local(a))

    await a.moves.finish(made.id, "b")
    assert a.store.get_sandbox(made.id).state == S.deleted
    assert a.registry.vm(made.id) is None
    assert not a.registry.directory(made.id).exists()
    assert a.store.get_snapshot(export.snapshot_id).state == "deleted"
    assert "moved" in [e.type for e in a.store.events(made.id)]

    # stopped on b, it moves back to a (where its old row ended) and boots there
    await b.lifecycle.stop(T, made.id)
    back = await b.moves.export(made.id)
    assert back.state == "stopped" and back.held_ms == 0
    await a.moves.take_in(importing(back), Local(b))
    await b.moves.finish(made.id, "a")
    home = a.store.get_sandbox(made.id)
    assert home.state == S.stopped and home.pid is None
    resumed = await a.lifecycle.resume(T, made.id)
    assert resumed.state == S.running


async def test_an_aborted_move_leaves_it_running_where_it_was(
    nodes: tuple[Daemon, Daemon],
) -> None:
    a, b = nodes
    made = await a.lifecycle.create(T, SandboxCreate())
    export = await a.moves.export(made.id)
    with pytest.raises(TimeoutError):  # nothing resumes it here while it travels
        await asyncio.wait_for(a.lifecycle.resume(T, made.id), 0.2)
    assert vm_of(a, made.id).paused

    class Broken(Local):
        async def pull(self, snapshot_id: str, name: str, dest: Path) -> None:
            raise errors.NodeUnavailable("the source went away")

    with pytest.raises(errors.NodeUnavailable):
        await b.moves.take_in(importing(export), Broken(a))
    assert b.store.get_sandbox(made.id) is None  # nothing of it on b
    await a.moves.abort(made.id, "the source went away")
    assert a.store.get_sandbox(made.id).state == S.running
    assert not vm_of(a, made.id).paused
    assert a.store.get_snapshot(export.snapshot_id).state == "deleted"
    assert "move_failed" in [e.type for e in a.store.events(made.id)]
    with pytest.raises(errors.InvalidState):  # nothing to finish any more
        await a.moves.finish(made.id)
    # the control: the same sandbox moves once the source answers
    again = await a.moves.export(made.id)
    await b.moves.take_in(importing(again), Local(a))
    assert b.store.get_sandbox(made.id).state == S.running


async def test_a_paused_sandbox_stays_paused_and_a_broken_one_stays(
    nodes: tuple[Daemon, Daemon],
) -> None:
    a, b = nodes
    made = await a.lifecycle.create(T, SandboxCreate())
    await a.lifecycle.pause(T, made.id)
    export = await a.moves.export(made.id)
    assert export.state == "paused"
    await b.moves.take_in(importing(export), Local(a))
    assert b.store.get_sandbox(made.id).state == S.paused and vm_of(b, made.id).paused
    await b.lifecycle.resume(T, made.id)
    assert b.store.get_sandbox(made.id).state == S.running
    with pytest.raises(errors.NotFound):
        await a.moves.export("sb-nope")


async def test_a_precopy_holds_the_sandbox_and_its_abort_merges_and_lets_go(
    nodes: tuple[Daemon, Daemon],
) -> None:
    a, _ = nodes
    made = await a.lifecycle.create(T, SandboxCreate())
    offer = await a.moves.precopy.start(made.id)
    assert offer.snapshot_id and offer.ram_sha256 is None  # the fake VM's RAM is its own
    split = a.registry.directory(made.id) / "disk.top"
    assert split.exists() and not vm_of(a, made.id).paused  # split, running on
    pre = a.store.get_snapshot(offer.snapshot_id)
    assert pre.state == "ready" and not pre.memory
    with pytest.raises(errors.InvalidState):  # once at a time
        await a.moves.precopy.start(made.id)
    with pytest.raises(TimeoutError):  # nothing stops or snapshots it while it is split
        await asyncio.wait_for(a.lifecycle.stop(T, made.id), 0.2)

    await a.moves.abort(made.id, "the destination refused")
    assert not split.exists()  # merged back
    assert a.store.get_snapshot(offer.snapshot_id).state == "deleted"
    assert a.store.get_sandbox(made.id).state == S.running
    assert "move_failed" in [e.type for e in a.store.events(made.id)]
    # its lock is free again: a snapshot goes through
    snap = await a.snapshots.snapshot(T, made.id, "after")
    assert snap.state == "ready"


async def test_an_export_that_fails_after_a_precopy_leaves_it_running_merged(
    nodes: tuple[Daemon, Daemon],
) -> None:
    a, _ = nodes
    made = await a.lifecycle.create(T, SandboxCreate())
    offer = await a.moves.precopy.start(made.id)

    async def broken(sandbox_id: str, snap: object) -> None:
        raise errors.CellaError("the snapshot's disk could not be rebased")

    a.moves.precopy.freeze = broken  # type: ignore[method-assign]
    with pytest.raises(errors.CellaError, match="rebased"):
        await a.moves.export(made.id)
    assert not vm_of(a, made.id).paused  # thawed at once
    await a.moves.abort(made.id, "export failed")
    assert not (a.registry.directory(made.id) / "disk.top").exists()
    assert a.store.get_snapshot(offer.snapshot_id).state == "deleted"
    assert a.store.get_sandbox(made.id).state == S.running
    await a.lifecycle.stop(T, made.id)  # its lock is free again
    assert a.store.get_sandbox(made.id).state == S.stopped


async def test_a_sandbox_moves_only_where_its_volumes_are_reachable(
    nodes: tuple[Daemon, Daemon],
) -> None:
    """The destination takes in a sandbox mounting a volume only when the volume is its own
    or lent to it (a fleet's gateway lends it first); else it refuses by the volume's id,
    nothing of the sandbox made there, and the source lets it run on."""
    a, b = nodes
    vol = a.volumes.create(T, "data")
    made = await a.lifecycle.create(T, SandboxCreate())
    a.registry.update(made.id, volume_mounts=[VolumeMount(volume=vol.id, path="/mnt/d")])
    export = await a.moves.export(made.id)  # the source does not know where it goes
    with pytest.raises(errors.InvalidState, match=vol.id):
        await b.moves.take_in(importing(export), Local(a))
    assert b.store.get_sandbox(made.id) is None
    await a.moves.abort(made.id, "refused")
    assert a.store.get_sandbox(made.id).state == S.running

    # lent by the gateway (the home's URL and the volume's token there): it moves
    b.volumes.remote.put(RemoteVolume(vol.id, "t", "data", "http://a", "token"))
    again = await a.moves.export(made.id)
    await b.moves.take_in(importing(again), Local(a))
    there = b.store.get_sandbox(made.id)
    assert there.state == S.running and [m.volume for m in there.volume_mounts] == [vol.id]
    # the volume's own node takes it back as well (the control: a volume of its own)
    b.volumes.reachable("t", [{"volume": vol.id, "path": "/mnt/d"}])
    a.volumes.reachable("t", json.dumps([{"volume": vol.id, "path": "/mnt/d"}]))
    with pytest.raises(errors.InvalidState):  # another tenant's is no volume of its
        a.volumes.reachable("u", [{"volume": vol.id, "path": "/mnt/d"}])
