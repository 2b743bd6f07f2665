"""Snapshots and forks: a running sandbox's disk and memory saved at one instant, and new
sandboxes restored from such a snapshot.

Owns snapshot rows and directories (`DATA_DIR/snapshots/<id>`), their names and tags (a
tag points at one snapshot of a name and moves, as Docker's do; `name:tag`, a bare name or
an id resolve to a snapshot), the free-space check before a snapshot and the `no_space`
answer when the disk fills during one, fork admission, sandboxes booted from a snapshot, and
the refcount that keeps a snapshot while sandboxes or snapshots are built on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
from pathlib import Path

from cella import errors
from cella.models import SandboxCreate, SandboxState, SnapshotState
from cella.service.admission import Admission
from cella.service.lifecycle import Lifecycle, new_record, spec_of
from cella.service.registry import Registry, error_text
from cella.service.warm import new_sandbox_id
from cella.storage.snapshots import SnapshotDir
from cella.store import SandboxRecord, SnapshotRecord

S = SandboxState
FORK_PARALLEL = 4  # restores at once: more only queue for the same cores


class Snapshots:
    def __init__(self, registry: Registry, admission: Admission, lifecycle: Lifecycle) -> None:
        self.registry = registry
        self.store = registry.store
        self.driver = registry.driver
        self.events = registry.events
        self.admission = admission
        self.lifecycle = lifecycle

    @property
    def root(self) -> Path:
        return self.driver.paths.root / "snapshots"

    def get(self, tenant: str, snapshot_id: str) -> SnapshotRecord:
        row = self.store.get_snapshot(snapshot_id)
        if row is None or row.tenant != tenant or row.state == SnapshotState.deleted:
            raise errors.NotFound(f"no snapshot {snapshot_id!r}")
        return row

    def find(self, tenant: str) -> list[SnapshotRecord]:
        return self.store.list_snapshots(tenant, ["creating", "ready", "error"])

    def resolve(self, tenant: str, ref: str) -> SnapshotRecord:
        """A snapshot by id, `name:tag`, or bare name (its `latest` tag, else the newest
        ready snapshot of that name)."""
        with contextlib.suppress(errors.NotFound):
            return self.get(tenant, ref)
        name, _, tag = ref.partition(":")
        for tagged_name, tagged, snapshot_id in self.store.tags(tenant, name):
            if tagged_name == name and tagged == (tag or "latest"):
                return self.get(tenant, snapshot_id)
        if not tag:
            ready = [s for s in self.find(tenant) if s.name == name and s.state == "ready"]
            if ready:
                return ready[-1]
        raise errors.NotFound(f"no snapshot {ref!r}")

    def tag(self, tenant: str, snapshot_id: str, tag: str) -> None:
        """Points `name:tag` (the snapshot's name) at this snapshot."""
        snap = self.get(tenant, snapshot_id)
        self.store.set_tag(tenant, snap.name, tag, snap.id)

    def tags(self, tenant: str, name: str) -> list[tuple[str, str]]:
        """(tag, snapshot id) of a name; `NotFound` if no snapshot ever had the name."""
        tags = [(t, sid) for _, t, sid in self.store.tags(tenant, name)]
        if not tags and not any(s.name == name for s in self.find(tenant)):
            raise errors.NotFound(f"no snapshot named {name!r}")
        return tags

    def tags_of(self, tenant: str, snapshot_id: str) -> list[str]:
        return [t for _, t, sid in self.store.tags(tenant) if sid == snapshot_id]

    async def snapshot(
        self, tenant: str, sandbox_id: str, name: str, tag: str | None = None
    ) -> SnapshotRecord:
        """Disk and memory of a running sandbox at one instant; it runs on afterwards. With
        `tag`, `name:tag` points at it once it is ready."""
        async with self.registry.lock(sandbox_id):
            row, vm = self.registry.live(tenant, sandbox_id)
            record = self.store.insert_snapshot(
                SnapshotRecord(
                    id=f"snap-{os.urandom(8).hex()}",
                    tenant=tenant,
                    name=name,
                    sandbox_id=sandbox_id,
                    parent_snapshot_id=row.base_snapshot_id,
                    state=SnapshotState.creating,
                    template=row.template,
                    vcpus=row.vcpus,
                    memory_mib=row.memory_mib,
                )
            )
            self.root.mkdir(parents=True, exist_ok=True)
            dest = SnapshotDir(self.root / record.id)
            try:
                self._check_space(row)
                manifest, paused = await self.driver.snapshot_vm(
                    vm, dest, template=row.template, sandbox_id=sandbox_id
                )
            except BaseException as exc:
                if not isinstance(exc, errors.NoSpace) and self._short_of_space(row):
                    exc = errors.NoSpace(f"the data directory ran out of space: {exc}")
                self.store.update_snapshot(record.id, state="error", error=error_text(exc))
                raise exc from None
            paused_ms = round(paused * 1000, 1)
            self.store.update_snapshot(
                record.id,
                state="ready",
                size_bytes=sum(manifest["bytes"].values()),
                paused_ms=paused_ms,
            )
            if tag:
                self.store.set_tag(tenant, name, tag, record.id)
            self.events.emit(
                sandbox_id,
                "snapshot",
                {"snapshot_id": record.id, "name": name, "tag": tag, "paused_ms": paused_ms},
            )
        return self.get(tenant, record.id)

    def _needs(self, row: SandboxRecord) -> int:
        """Bytes a snapshot of this sandbox may take at most: all of its RAM, its overlay."""
        return row.memory_mib * (1 << 20) + self.registry.disk_bytes(row.id)

    def _short_of_space(self, row: SandboxRecord) -> bool:
        """A failed snapshot that could not have fit (what it wrote is already removed)."""
        return shutil.disk_usage(self.root).free < self._needs(row)

    def _check_space(self, row: SandboxRecord) -> None:
        free = shutil.disk_usage(self.root).free
        if free < self._needs(row):
            raise errors.NoSpace(
                f"a snapshot of {row.id} may need {self._needs(row) >> 20} MiB; "
                f"{self.root} has {free >> 20} MiB free"
            )

    async def fork(self, tenant: str, sandbox_id: str, count: int) -> list[SandboxRecord]:
        """Snapshots a running sandbox once, then restores `count` branches from it."""
        snap = await self.snapshot(tenant, sandbox_id, f"fork of {sandbox_id}")
        return await self.fork_snapshot(tenant, snap.id, count)

    async def boot(self, tenant: str, spec: SandboxCreate) -> SandboxRecord:
        """A new sandbox from `spec.snapshot` (its files, memory and processes), made as
        `spec` says otherwise (name, limits, egress, secrets); its shape is the snapshot's."""
        assert spec.snapshot is not None
        snap = self.resolve(tenant, spec.snapshot)
        self.admission.check_shape(snap.vcpus, snap.memory_mib, spec.disk_mib)
        [row] = await self.fork_snapshot(tenant, snap.id, 1, spec)
        return row

    async def fork_snapshot(
        self, tenant: str, snapshot_id: str, count: int, spec: SandboxCreate | None = None
    ) -> list[SandboxRecord]:
        """`count` new sandboxes restored from the snapshot, each on its own overlay, made
        like the snapshot's source unless `spec` says otherwise."""
        snap_row = self.get(tenant, snapshot_id)
        if snap_row.state != SnapshotState.ready:
            raise errors.InvalidState(f"snapshot {snapshot_id} is {snap_row.state}")
        snap = SnapshotDir(self.root / snapshot_id)
        snap.verify()  # refuse a corrupted snapshot before creating anything
        source = self.store.get_sandbox(snap_row.sandbox_id)
        if source is None:
            raise errors.NotFound(f"the source of snapshot {snapshot_id} is gone")
        if spec is None:  # the same placeholders: the parent's env is copied with its memory
            spec, secrets = spec_of(source), source.secrets
        else:
            secrets = self.lifecycle.egress.bind_secrets(tenant, spec.secrets)
        shape = {"vcpus": snap_row.vcpus, "memory_mib": snap_row.memory_mib}
        spec = spec.model_copy(update=shape)
        async with self.admission.admit(tenant, snap_row.vcpus, snap_row.memory_mib, count):
            self.registry.check_name(tenant, spec.name)
            rows = [
                self.registry.insert(
                    new_record(
                        tenant,
                        new_sandbox_id(),
                        spec,
                        secrets,
                        "fork",
                        parent_id=snap_row.sandbox_id,
                        snapshot_id=snap_row.id,
                        base_snapshot_id=snap_row.id,
                    )
                )
                for _ in range(count)
            ]
        gate = asyncio.Semaphore(FORK_PARALLEL)

        async def one(row: SandboxRecord) -> str:
            async with gate:
                return await self._restore_fork(snap_row, snap, row)

        results = await asyncio.gather(*(one(r) for r in rows), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            for result in results:
                if isinstance(result, str):
                    await self.lifecycle.delete(tenant, result)
            raise failed[0]
        return [self.registry.get(tenant, r.id) for r in rows]

    async def _restore_fork(
        self, snap_row: SnapshotRecord, snap: SnapshotDir, row: SandboxRecord
    ) -> str:
        async with self.registry.lock(row.id):
            vm = None
            try:
                vm = await self.lifecycle.restore_vm(snap, row.id)
                await self.lifecycle.ready(vm, row)  # the parent's policy and placeholders
            except BaseException as exc:
                if vm is not None:
                    await self.driver.destroy(vm)
                self.driver.remove_directory(self.registry.directory(row.id))
                self.registry.fail(row.id, exc)
                raise
            self.lifecycle.running(row.id, vm)
            self.events.emit(
                row.id,
                "forked",
                {
                    "parent_id": snap_row.sandbox_id,
                    "snapshot_id": snap_row.id,
                    "restore_ms": round((vm.boot_seconds or 0) * 1000, 1),
                },
            )
        return row.id

    async def delete(self, tenant: str, snapshot_id: str) -> None:
        """Refused (`in_use`) while a sandbox or another snapshot is built on it."""
        self.get(tenant, snapshot_id)
        sandboxes, snapshots = self.store.snapshot_users(snapshot_id)
        if sandboxes or snapshots:
            users = ", ".join([*sandboxes, *snapshots][:10])
            raise errors.InUse(f"snapshot {snapshot_id} is still used by {users}")
        shutil.rmtree(self.root / snapshot_id, ignore_errors=True)
        self.store.untag_snapshot(snapshot_id)
        self.store.update_snapshot(snapshot_id, state="deleted")
