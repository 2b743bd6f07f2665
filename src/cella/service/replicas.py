"""Replicas: a fleet keeps a copy of a replicated sandbox's disk on a second node (a
disk-only snapshot, shipped there as snapshots are). When the sandbox's node is lost, the
node holding the copy makes it that sandbox again: same id, name and creator, made as it
was made (its egress rules and secrets), `stopped` on a new overlay over the copy, which
it keeps while the sandbox lives. Nothing boots until it is resumed.
"""

from __future__ import annotations

import asyncio
import time

from cella import errors
from cella.models import SandboxCreate, SandboxState
from cella.models.fleet import ReplicaRecover
from cella.policy.access import Principal
from cella.service.registry import Registry, iso
from cella.service.sandbox_rows import new_record
from cella.service.snapshots import Snapshots
from cella.storage.overlay import create_overlay
from cella.store import SandboxRecord

S = SandboxState


class Replicas:
    def __init__(self, registry: Registry, snapshots: Snapshots) -> None:
        self.registry = registry
        self.store = registry.store
        self.snapshots = snapshots

    @staticmethod
    def refuse_here(spec: SandboxCreate) -> None:
        """A create sent to a daemon that asks for a replica: a fleet's gateway keeps
        replicas (and sends none of its creates on with it)."""
        if spec.replicate:
            raise errors.InvalidArgument(
                "replicate: a replica lives on a second node of a fleet, and this daemon is "
                "one host (create the sandbox through a fleet gateway)"
            )

    async def recover(self, snapshot_id: str, ask: ReplicaRecover) -> SandboxRecord:
        """The sandbox whose replica `snapshot_id` is, here again under its own id,
        stopped (any tenant's: the fleet's gateway asks)."""
        snap_row = self.snapshots.ready(snapshot_id)
        if snap_row.sandbox_id != ask.sandbox_id:
            raise errors.InvalidArgument(
                f"snapshot {snapshot_id} is a copy of {snap_row.sandbox_id}, not {ask.sandbox_id}"
            )
        async with self.registry.lock(ask.sandbox_id):
            if self.store.get_sandbox(ask.sandbox_id) is not None:
                raise errors.Conflict(f"this node already has a sandbox {ask.sandbox_id}")
            snap = self.snapshots.directory(snapshot_id)
            await asyncio.to_thread(snap.verify)  # a damaged copy is refused before a row
            spec, secrets = self.snapshots.source_of(snap_row)
            spec = spec.model_copy(
                update={
                    "name": ask.name,
                    "vcpus": snap_row.vcpus,
                    "memory_mib": snap_row.memory_mib,
                    "visibility": ask.visibility or spec.visibility,
                }
            )
            creator = Principal(snap_row.tenant, False, name=ask.creator or "")
            row = self.registry.insert(
                new_record(
                    creator,
                    ask.sandbox_id,
                    spec,
                    secrets,
                    "recovered",
                    snapshot_id=snap_row.id,
                    base_snapshot_id=snap_row.id,
                )
            )
            directory = self.registry.directory(row.id)
            try:
                directory.mkdir(parents=True)
                await asyncio.to_thread(create_overlay, snap.disk, directory / row.disk)
            except BaseException as exc:
                self.registry.fail(row.id, exc)
                raise
            self.registry.update(row.id, state=S.stopped, stopped_at=iso(time.time()))
            self.registry.events.emit(row.id, "recovered", ask.event)
        done = self.store.get_sandbox(row.id)
        assert done is not None
        return done
