"""Moves: a sandbox leaving this node for another one, or arriving from one, same id.

The node primitive under a fleet's `move` and `drain` (the gateway drives it; any two node
daemons can use it, with an admin key of the source):

1. `export` on the source freezes the sandbox and snapshots it: a running one is snapshotted
   with its memory and left paused (the guest is frozen at the snapshot's instant, so
   nothing it does after is lost); a paused one likewise; a stopped one's disk overlay is
   taken as a snapshot without memory. The answer (`SandboxExport`) carries the sandbox's
   row as stored: id, name, tenant, spec, egress rules, secrets' bindings, exec policy,
   labels, access delegation, so service URL host names and the like stay the same.
2. `take_in` on the destination pulls that snapshot from the source (`shipping`, checked
   against its manifest), writes the row under the same id and restores the VM from the
   snapshot (running, or paused again), or lays out the disk of a stopped one; it refuses
   a sandbox mounting a volume that is neither its own nor lent to it (`volumes_here`).
3. `finish` on the source, once the destination answers: the old VM and files go, the
   snapshot with them; the row stays as `deleted` (a `moved` event says where it went).
   Or `abort`: the sandbox runs on here as before (a paused or stopped one stays so).

A running sandbox's move starts with a pre-copy (`cella.service.precopy`): its disk so far
and the RAM file under its memory go to the destination while the guest runs, so the
freeze ships only its RAM layer, device state and the disk written since. The move's
snapshot travels as it is (a RAM layer is not flattened first), as its non-zero pieces.

A daemon restarted between 1 and 3 finds the sandbox paused (its VM adopted, its disk
merged back if a pre-copy had split it) with the move's snapshot beside it; `abort` still
resumes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from cella import errors
from cella.models import SandboxState
from cella.models.fleet import SandboxExport, SandboxImport, SandboxImported, SnapshotExport
from cella.policy.access import Principal
from cella.service.lifecycle import Lifecycle
from cella.service.precopy import Precopies
from cella.service.registry import Registry, error_text
from cella.service.shipping import Shipping
from cella.service.snapshots import Snapshots
from cella.service.transfer import NodeSource
from cella.store import SandboxRecord, SnapshotRecord, sandbox_columns

S = SandboxState
MOVABLE = (S.running, S.paused, S.stopped)


class SnapshotSource(Protocol):
    """Another node's snapshots: what `shipping` takes one in from (`NodeSource`)."""

    async def export(self, snapshot_id: str) -> SnapshotExport: ...

    async def pull(self, snapshot_id: str, name: str, dest: Path) -> object: ...


def move_name(sandbox_id: str) -> str:
    """The name of a move's snapshot (the tenant sees it among its snapshots meanwhile)."""
    return f"move of {sandbox_id}"


class Moves:
    def __init__(
        self, registry: Registry, lifecycle: Lifecycle, snapshots: Snapshots, shipping: Shipping
    ) -> None:
        self.registry = registry
        self.store = registry.store
        self.driver = registry.driver
        self.events = registry.events
        self.lifecycle = lifecycle
        self.snapshots = snapshots
        self.shipping = shipping
        self.precopy = Precopies(registry, snapshots, shipping)
        self._out: dict[str, SandboxExport] = {}  # sandbox id -> its export, until settled
        self._busy: set[str] = set()  # being exported
        self._held: dict[str, asyncio.Lock] = {}  # their locks, held until settled
        # (tenant, a row's volume mounts): refuses a sandbox whose volumes this node lacks
        self.volumes_here: Callable[[str, Any], None] = lambda _tenant, _mounts: None

    # -- the source ----------------------------------------------------------------------

    async def export(self, sandbox_id: str) -> SandboxExport:
        """Freezes the sandbox and snapshots it for another node (see the module's doc).
        Its lock is held from then until `finish` or `abort`: nothing resumes, stops or
        boots it here meanwhile (an exec is refused: it is paused)."""
        row = self._row(sandbox_id)
        if sandbox_id in self._out or sandbox_id in self._busy:
            raise errors.InvalidState(f"sandbox {sandbox_id} is being moved already")
        if row.state not in MOVABLE:
            raise errors.InvalidState(f"cannot move a sandbox that is {row.state}")
        self._busy.add(sandbox_id)
        try:
            export = await self._export(row)
        finally:
            self._busy.discard(sandbox_id)
        self._out[sandbox_id] = export
        self.events.emit(
            sandbox_id, "move_started", {"snapshot_id": export.snapshot_id, "state": row.state}
        )
        return export

    async def _export(self, row: SandboxRecord) -> SandboxExport:
        sandbox_id, was = row.id, row.state
        who = Principal.service(row.tenant)
        loop = asyncio.get_running_loop()
        lock = self.registry.lock(sandbox_id)
        pre_lock = self.precopy.holds(sandbox_id)  # a pre-copy split its disk: held since
        if was == S.stopped:
            snap = await self.disk_snapshot(row, move_name(row.id))
            paused = 0.0
        else:
            if was == S.paused:  # it runs for the snapshot's sync, then is frozen again
                await self.lifecycle.resume(who, sandbox_id)
            try:
                snap = await self.snapshots.snapshot(
                    who,
                    sandbox_id,
                    move_name(sandbox_id),
                    leave_paused=True,
                    held=pre_lock is not None,
                    flatten=False,  # it travels as its layer
                )
            except BaseException:  # a failed snapshot may leave the VM paused
                if (vm := self.registry.vm(sandbox_id)) is not None:
                    await vm.resume()
                raise
            paused = (snap.paused_ms or 0.0) / 1000
        if pre_lock is None:
            await lock.acquire()
        frozen = loop.time()
        try:
            now = self._row(sandbox_id).state
            if now != (S.stopped if was == S.stopped else S.running):  # changed meanwhile
                raise errors.InvalidState(f"sandbox {sandbox_id} became {now} during the move")
            if was != S.stopped:
                self.registry.update(sandbox_id, state=S.paused)
            await self.precopy.freeze(sandbox_id, snap)
            manifest = self.snapshots.directory(snap.id).manifest()
            described = self.shipping.describe(snap.id)
        except BaseException:
            await self._thaw(sandbox_id, was, snap.id)
            if pre_lock is None:  # else the pre-copy's abort releases it
                lock.release()
            raise
        self.precopy.hand_over(sandbox_id)
        self._held[sandbox_id] = lock
        return SandboxExport(
            sandbox=sandbox_columns(self._row(sandbox_id)) | {"state": was.value},
            state=was.value,  # type: ignore[arg-type]  # one of MOVABLE
            snapshot_id=snap.id,
            held_ms=round((paused + loop.time() - frozen) * 1000, 1) if paused else 0.0,
            bytes=sum(int(n) for n in manifest.get("bytes", {}).values()),
            snapshot=described,
        )

    async def abort(self, sandbox_id: str, reason: str = "") -> None:
        """The move did not happen: the sandbox runs on here as it was (idempotent)."""
        export = self._out.pop(sandbox_id, None)
        if export is None:  # failed before its export (or after a restart): a pre-copy?
            if await self.precopy.abort(sandbox_id):
                self.events.emit(sandbox_id, "move_failed", {"error": reason or "aborted"})
            return
        try:
            await self._thaw(sandbox_id, S(export.state), export.snapshot_id)
            await self.precopy.abort(sandbox_id)  # its disk merged back, under the lock
        finally:
            self._release(sandbox_id)
        self.events.emit(sandbox_id, "move_failed", {"error": reason or "aborted"})

    async def finish(self, sandbox_id: str, node: str = "") -> None:
        """The destination has it: this node's copy goes (VM, files, the move's snapshot)."""
        export = self._out.pop(sandbox_id, None)
        if export is None:
            raise errors.InvalidState(f"sandbox {sandbox_id} is not being moved from here")
        try:
            await self.lifecycle.teardown(sandbox_id)
            self.registry.update(sandbox_id, state=S.deleted, pid=None)
        finally:
            self._release(sandbox_id)
        self.events.emit(sandbox_id, "moved", {"to": node})
        self.registry.forget(sandbox_id)
        await self._drop_snapshot(export.snapshot_id)
        await self.precopy.finish(sandbox_id)

    def _release(self, sandbox_id: str) -> None:
        lock = self._held.pop(sandbox_id, None)
        if lock is not None and lock.locked():
            lock.release()

    async def disk_snapshot(self, row: SandboxRecord, name: str) -> SnapshotRecord:
        """A stopped sandbox's disk as a snapshot without memory (a move's, a replica's)."""
        record = self.snapshots.creating_disk(row, name)
        async with self.registry.lock(row.id):
            if self._row(row.id).state != S.stopped:
                raise errors.InvalidState(f"sandbox {row.id} is no longer stopped")
            return await self.snapshots.copy_disk(row, record)

    async def _thaw(self, sandbox_id: str, was: S, snapshot_id: str) -> None:
        """Runs on as it was before the export (its lock held by the caller)."""
        if was == S.running and (vm := self.registry.vm(sandbox_id)) is not None:
            await vm.resume()
            self.registry.update(sandbox_id, state=S.running, stopped_at=None)
        await self._drop_snapshot(snapshot_id)

    async def _drop_snapshot(self, snapshot_id: str) -> None:
        snap = self.store.get_snapshot(snapshot_id)
        if snap is not None:
            with contextlib.suppress(errors.CellaError):
                await self.snapshots.delete(snap.tenant, snapshot_id)

    # -- the destination -----------------------------------------------------------------

    async def take_in(
        self, body: SandboxImport, source: SnapshotSource | None = None
    ) -> SandboxImported:
        """Another node's exported sandbox made this node's, same id, in the state it had
        there (running ones resume where they were frozen). `source`: where its snapshot
        comes from, by default the node `body` names (over HTTPS)."""
        export = body.export
        sandbox_id = str(export.sandbox.get("id", ""))
        have = self.store.get_sandbox(sandbox_id)
        if have is not None and have.state != S.deleted:
            raise errors.Conflict(f"this node already has sandbox {sandbox_id}")
        state = S(export.state)
        self.volumes_here(str(export.sandbox.get("tenant")), export.sandbox.get("volume_mounts"))
        if source is None:
            source = NodeSource(body.source_url, body.source_key, body.source_ca)
        started = time.monotonic()
        snap_export = export.snapshot or await source.export(export.snapshot_id)
        pulled = 0
        self.precopy.expect(sandbox_id, snap_export)
        pull = self.precopy.pull(sandbox_id, source.pull)

        async def counted(snapshot_id: str, name: str, dest: Path) -> object:
            nonlocal pulled
            got = await pull(snapshot_id, name, dest)
            pulled += got if isinstance(got, int) else 0
            return got

        try:
            snap = await self.shipping.take_in(snap_export, source.export, counted)
        except BaseException:
            await self.precopy.drop(sandbox_id)
            raise
        transfer = time.monotonic() - started
        started = time.monotonic()
        try:
            if snap.tenant != export.sandbox.get("tenant"):
                raise errors.InvalidArgument("the snapshot is not the sandbox's tenant's")
            await self._restore(export, snap, state)
        except BaseException:
            with contextlib.suppress(errors.CellaError):
                await self.snapshots.delete(snap.tenant, snap.id)
            await self.precopy.drop(sandbox_id)
            raise
        self.precopy.settled(sandbox_id)
        self.events.emit(sandbox_id, "moved_in", {"snapshot_id": snap.id, "state": state})
        row = self.store.get_sandbox(sandbox_id)
        assert row is not None
        return SandboxImported(
            sandbox=sandbox_columns(row),
            transfer_ms=round(transfer * 1000, 1),
            restore_ms=round((time.monotonic() - started) * 1000, 1),
            bytes=pulled,
        )

    async def _restore(self, export: SandboxExport, snap: SnapshotRecord, state: S) -> None:
        columns = export.sandbox | {
            "state": S.stopped if state == S.stopped else S.starting,
            "pid": None,
            "base_snapshot_id": snap.id,
            "error": None,
        }
        live = state != S.stopped
        admit = (
            self.lifecycle.admission.admit(snap.tenant, snap.vcpus, snap.memory_mib)
            if live
            else contextlib.nullcontext()
        )
        async with admit:
            row = self.store.replace_sandbox(columns)
        sandbox_id = row.id
        directory = self.registry.directory(sandbox_id)
        snap_dir = self.snapshots.directory(snap.id)
        async with self.registry.lock(sandbox_id):
            if not live:
                try:
                    await self.driver.overlay_from(snap_dir, directory)
                except BaseException as exc:
                    self._undo(sandbox_id, exc)
                    raise
                return
            vm = None
            try:
                vm = await self.lifecycle.restore_vm(snap_dir, sandbox_id)
                await self.lifecycle.ready(vm, row)
                if state == S.paused:
                    await vm.pause()
            except BaseException as exc:
                if vm is not None:
                    await self.driver.destroy(vm)
                self.driver.remove_directory(directory)
                self._undo(sandbox_id, exc)
                raise
            self.lifecycle.running(sandbox_id, vm)
            if state == S.paused:
                self.registry.update(sandbox_id, state=S.paused)

    def _undo(self, sandbox_id: str, exc: BaseException) -> None:
        """A failed take-in leaves no sandbox here (it is still the source's)."""
        self.registry.update(sandbox_id, state=S.deleted, pid=None, error=error_text(exc))
        self.registry.forget(sandbox_id)

    def _row(self, sandbox_id: str) -> SandboxRecord:
        row = self.store.get_sandbox(sandbox_id)
        if row is None or row.state == S.deleted:
            raise errors.NotFound(f"no sandbox {sandbox_id!r}")
        return row
