"""Replicas: a fleet keeps a copy of a replicated sandbox's disk (and memory) on a second
node.

The sandbox's node takes the copy (`take`) with the sandbox's row as stored, in the shape a
move exports (`SandboxExport`): a paused sandbox's disk and memory (its guest runs for the
sync, then is frozen again at the snapshot's instant), state `paused`; a running one's the
same when the gateway asks for its memory (a live snapshot: the guest pauses for the copy,
`held_ms`), else its disk alone (its writes synced first), state `stopped`; a stopped one's
overlay as it is. The gateway ships the snapshot to the replica's node as snapshots are
shipped and keeps the export. When the sandbox's node is lost, the replica's node takes it
in as a move's destination does (`Moves.take_in`), its snapshot already here: same id,
name, creator, egress rules and secrets' bindings, on an overlay over the copy (kept while
the sandbox lives): restored and paused again when the copy has memory (a resume goes on
with its processes), else `stopped` (nothing boots until it is resumed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from cella import errors
from cella.models import SandboxCreate, SandboxState
from cella.models.fleet import SandboxExport, SandboxImport, SnapshotExport
from cella.policy.access import Principal
from cella.service.moves import Moves
from cella.service.registry import Registry
from cella.service.shipping import Shipping
from cella.service.snapshots import Snapshots
from cella.store import SandboxRecord, sandbox_columns

S = SandboxState


def replica_name(sandbox_id: str) -> str:
    return f"replica of {sandbox_id}"


class HeldHere:
    """The snapshot source of a replica this node already holds (nothing to pull)."""

    def __init__(self, shipping: Shipping) -> None:
        self.shipping = shipping

    async def export(self, snapshot_id: str) -> SnapshotExport:
        return await self.shipping.export(snapshot_id)

    async def pull(self, snapshot_id: str, name: str, dest: Path) -> None:
        raise errors.NotFound(f"snapshot {snapshot_id} is not held here")


class Replicas:
    def __init__(
        self, registry: Registry, snapshots: Snapshots, shipping: Shipping, moves: Moves
    ) -> None:
        self.registry = registry
        self.store = registry.store
        self.snapshots = snapshots
        self.shipping = shipping
        self.moves = moves

    @staticmethod
    def refuse_here(spec: SandboxCreate) -> None:
        """A create sent to a daemon that asks for a replica: a fleet's gateway keeps
        replicas (and sends none of its creates on with it)."""
        if spec.replicate:
            raise errors.InvalidArgument(
                "replicate: a replica lives on a second node of a fleet, and this daemon is "
                "one host (create the sandbox through a fleet gateway)"
            )

    async def take(self, sandbox_id: str, memory: bool = False) -> SandboxExport:
        """The sandbox now, as a snapshot with its row (any tenant's: the fleet's gateway
        asks): a paused one's disk and memory, a running one's too with `memory` (else its
        disk alone), a stopped one's disk. It runs on, stays paused or stays stopped."""
        row = self._row(sandbox_id)
        who = Principal.service(row.tenant)
        name = replica_name(sandbox_id)
        if row.state == S.paused or (row.state == S.running and memory):
            snap = await self.snapshots.snapshot(  # not the tenant's use: no idle reset
                who, sandbox_id, name, activity=False, paused_too=True
            )
        elif row.state == S.running:
            snap = await self.snapshots.snapshot(
                who, sandbox_id, name, memory=False, activity=False
            )
        elif row.state == S.stopped:
            snap = await self.moves.disk_snapshot(row, name)
        else:
            raise errors.InvalidState(f"sandbox {sandbox_id} is {row.state}: no copy now")
        state: Literal["paused", "stopped"] = "paused" if snap.memory else "stopped"
        return SandboxExport(
            sandbox=sandbox_columns(self._row(sandbox_id)) | {"state": state},
            state=state,
            snapshot_id=snap.id,
            # the running guest's pause for the copy (a paused one's is none of its own)
            held_ms=(snap.paused_ms or 0.0) if row.state == S.running else 0.0,
            bytes=snap.size_bytes or 0,
        )

    async def recover(self, export: SandboxExport, event: dict[str, Any]) -> SandboxRecord:
        """The sandbox of a replica held here, taken in under its own id: paused again
        from the copy's memory, or stopped when it has none; its trace says it was
        recovered (`event`: from where, how old the copy was, as what)."""
        snap = self.snapshots.ready(export.snapshot_id)
        if snap.sandbox_id != export.sandbox.get("id"):
            raise errors.InvalidArgument(
                f"snapshot {snap.id} is a copy of {snap.sandbox_id}, not {export.sandbox.get('id')}"
            )
        state = "paused" if snap.memory and export.state != "stopped" else "stopped"
        export = export.model_copy(update={"state": state})
        body = SandboxImport.model_construct(export=export)  # its snapshot is here already
        await self.moves.take_in(body, source=HeldHere(self.shipping))
        row = self._row(snap.sandbox_id)
        self.registry.events.emit(row.id, "recovered", {**event, "state": state})
        return row

    def _row(self, sandbox_id: str) -> SandboxRecord:
        row = self.store.get_sandbox(sandbox_id)
        if row is None or row.state == S.deleted:
            raise errors.NotFound(f"no sandbox {sandbox_id!r}")
        return row
