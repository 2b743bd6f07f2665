"""Snapshots and forks: a running sandbox's disk and memory saved at one instant, and new
sandboxes restored from such a snapshot.

Owns snapshot rows and directories (`DATA_DIR/snapshots/<id>`), their names and tags (a
tag points at one snapshot of a name and moves, as Docker's do; `name:tag`, a bare name or
an id resolve to a snapshot), the free-space check before a snapshot and the `no_space`
answer when the disk fills during one, fork admission, sandboxes booted from a snapshot, and
the refcount that keeps a snapshot while sandboxes or snapshots are built on it.

A snapshot of a sandbox restored from a snapshot starts as a RAM layer over its base
(only the pages the sandbox wrote; the pause is short) and is flattened in the background;
a fork of several branches and a move to another node wait for the flat RAM file, which
their VMs share.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path

from cella import errors
from cella.models import SandboxCreate, SandboxState, Snapshot, SnapshotState
from cella.models.fleet import SecretBinding, SnapshotExport
from cella.service.admission import Admission
from cella.service.lifecycle import Lifecycle, new_record, spec_of
from cella.service.registry import Registry, error_text
from cella.service.warm import new_sandbox_id
from cella.storage.overlay import backing_file, rebase_unsafe
from cella.storage.snapshots import FILES, SnapshotDir
from cella.store import SandboxRecord, SecretRef, SnapshotRecord

S = SandboxState
FORK_PARALLEL = 4  # restores at once: more only queue for the same cores
log = logging.getLogger("cella.snapshots")


class Snapshots:
    def __init__(self, registry: Registry, admission: Admission, lifecycle: Lifecycle) -> None:
        self.registry = registry
        self.store = registry.store
        self.driver = registry.driver
        self.events = registry.events
        self.admission = admission
        self.lifecycle = lifecycle
        self._flattening: dict[str, asyncio.Task[None]] = {}

    @property
    def root(self) -> Path:
        return self.driver.paths.root / "snapshots"

    def get(self, tenant: str, snapshot_id: str) -> SnapshotRecord:
        row = self.store.get_snapshot(snapshot_id)
        if row is None or row.tenant != tenant or row.state == SnapshotState.deleted:
            raise errors.NotFound(f"no snapshot {snapshot_id!r}")
        return row

    def find(self, tenant: str | None) -> list[SnapshotRecord]:
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
            if dest.is_layered(manifest):
                self._flatten_soon(record.id)
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

    def _flatten_soon(self, snapshot_id: str) -> None:
        if snapshot_id not in self._flattening:
            task = asyncio.create_task(self._flatten(snapshot_id), name=f"flatten-{snapshot_id}")
            self._flattening[snapshot_id] = task
            task.add_done_callback(lambda _: self._flattening.pop(snapshot_id, None))

    async def _flatten(self, snapshot_id: str) -> None:
        try:
            manifest = await self.driver.flatten(SnapshotDir(self.root / snapshot_id))
        except Exception:
            # still whole as a layer: restores work as before, a later flat() tries again
            log.exception("flattening snapshot %s failed", snapshot_id)
            return
        self.store.update_snapshot(snapshot_id, size_bytes=sum(manifest["bytes"].values()))

    def flatten_left(self) -> int:
        """Flattens, in the background, the layers a previous daemon left; returns how many."""
        layered = [
            row.id
            for row in self.store.list_snapshots(None, ["ready"])
            if (snap := SnapshotDir(self.root / row.id)).exists() and snap.is_layered()
        ]
        for snapshot_id in layered:
            self._flatten_soon(snapshot_id)
        return len(layered)

    async def close(self) -> None:
        """Stops flattening (a layer left half-flattened is whole as a layer)."""
        tasks = list(self._flattening.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def flat(self, snapshot_id: str) -> None:
        """Waits until the snapshot has a RAM file of its own (a layer flattened)."""
        snap = SnapshotDir(self.root / snapshot_id)
        if snap.exists() and snap.is_layered():
            self._flatten_soon(snapshot_id)
        if task := self._flattening.get(snapshot_id):
            await asyncio.shield(task)
        if snap.exists() and snap.is_layered():
            raise errors.SnapshotCorrupt(f"snapshot {snapshot_id} could not be flattened")

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
        if count > 1:  # one shared RAM file beats a copy of the layer in every branch
            with contextlib.suppress(errors.SnapshotCorrupt):
                await self.flat(snap_row.id)  # if it cannot be, the layer restores as it is
        snap.verify()  # refuse a corrupted snapshot before creating anything
        if spec is None:  # the same placeholders: the parent's env is copied with its memory
            spec, secrets = self._source_of(snap_row)
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

    def _source_of(self, snap: SnapshotRecord) -> tuple[SandboxCreate, dict[str, SecretRef]]:
        """How the snapshot's sandbox was made, and the secrets its memory holds
        placeholders of: from its row, or kept with a snapshot taken in from another node."""
        kept = SnapshotDir(self.root / snap.id).source_path
        if kept.exists():
            data = json.loads(kept.read_text())
            secrets = {k: SecretRef(**v) for k, v in data["secrets"].items()}
            return SandboxCreate.model_validate(data["spec"]), secrets
        source = self.store.get_sandbox(snap.sandbox_id)
        if source is None:
            raise errors.NotFound(f"the source of snapshot {snap.id} is gone")
        return spec_of(source), source.secrets

    # -- moving snapshots between the nodes of a fleet -------------------------------------

    async def export(self, snapshot_id: str) -> SnapshotExport:
        """What another node needs to take this snapshot in (any tenant's: nodes ask); a
        layered snapshot is flattened first (nodes move whole RAM files)."""
        self._ready(snapshot_id)
        await self.flat(snapshot_id)
        return self._export(snapshot_id)

    def _ready(self, snapshot_id: str) -> SnapshotRecord:
        row = self.store.get_snapshot(snapshot_id)
        if row is None or row.state == SnapshotState.deleted:
            raise errors.NotFound(f"no snapshot {snapshot_id!r}")
        if row.state != SnapshotState.ready:
            raise errors.InvalidState(f"snapshot {snapshot_id} is {row.state}")
        return row

    def _export(self, snapshot_id: str) -> SnapshotExport:
        row = self._ready(snapshot_id)
        snap = SnapshotDir(self.root / snapshot_id)
        spec, secrets = self._source_of(row)
        backing = backing_file(snap.disk)
        parent = Path(backing).parent if backing else None
        on_snapshot = parent is not None and parent.parent == self.root.resolve()
        return SnapshotExport(
            snapshot=Snapshot.model_validate(row),
            tenant=row.tenant,
            manifest=snap.manifest(),
            source=spec,
            secrets={
                k: SecretBinding(secret=v.secret, placeholder=v.placeholder)
                for k, v in secrets.items()
            },
            backing_snapshot_id=parent.name if on_snapshot and parent else None,
            backing_path=None if on_snapshot else backing,
        )

    def file(self, snapshot_id: str, name: str) -> Path:
        """One of a ready snapshot's files, to send to another node."""
        self._ready(snapshot_id)
        if name not in (*SnapshotDir(self.root / snapshot_id).files(), "manifest.json"):
            raise errors.NotFound(f"a snapshot has no file {name!r}")
        return SnapshotDir(self.root / snapshot_id).path / name

    async def take_in(
        self,
        export: SnapshotExport,
        fetch: Callable[[str], Awaitable[SnapshotExport]],
        pull: Callable[[str, str, Path], Awaitable[None]],
    ) -> SnapshotRecord:
        """Another node's snapshot made local: the snapshots its disk sits on first
        (`fetch` gets their exports), its files pulled (`pull(snapshot id, file name,
        destination)`) and checked against its manifest, then a ready row of the same id and
        tenant. A snapshot already here is kept as it is: taken in once, then cached."""
        meta = export.snapshot
        async with self.registry.lock(meta.id):
            have = self.store.get_snapshot(meta.id)
            if have is not None and have.state == SnapshotState.ready:
                return have
            base: Path | None = None
            if export.backing_snapshot_id:
                parent = await self.take_in(await fetch(export.backing_snapshot_id), fetch, pull)
                base = SnapshotDir(self.root / parent.id).disk
            elif export.backing_path and not Path(export.backing_path).exists():
                raise errors.ImageMissing(
                    f"snapshot {meta.id} sits on {export.backing_path}, which this node lacks "
                    f"(build template {meta.template!r} here)"
                )
            for image in ("kernel", "initrd"):
                if not Path(str(export.manifest.get(image))).exists():
                    raise errors.ImageMissing(f"this node lacks the {image} of snapshot {meta.id}")
            need = sum(int(n) for n in export.manifest.get("bytes", {}).values())
            self.root.mkdir(parents=True, exist_ok=True)
            if shutil.disk_usage(self.root).free < need:
                raise errors.NoSpace(f"snapshot {meta.id} needs {need >> 20} MiB here")
            tmp = self.root / f".incoming-{meta.id}-{os.urandom(4).hex()}"
            tmp.mkdir()
            try:
                for name in FILES:
                    await pull(meta.id, name, tmp / name)
                incoming = SnapshotDir(tmp)
                incoming.manifest_path.write_text(json.dumps(export.manifest, sort_keys=True))
                await asyncio.to_thread(incoming.verify)
                if base is not None:
                    rebase_unsafe(incoming.disk, base)
                    incoming.reseal("disk.qcow2")
                incoming.source_path.write_text(
                    json.dumps(
                        {
                            "spec": export.source.model_dump(mode="json", exclude_unset=True),
                            "secrets": {k: v.model_dump() for k, v in export.secrets.items()},
                        }
                    )
                )
                for name in FILES:
                    (tmp / name).chmod(0o400)
                shutil.rmtree(self.root / meta.id, ignore_errors=True)
                tmp.rename(self.root / meta.id)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            fields = {
                "state": SnapshotState.ready,
                "name": meta.name,
                "size_bytes": meta.size_bytes,
                "paused_ms": meta.paused_ms,
                "error": None,
            }
            if have is not None:  # deleted or failed here before: the same id again
                self.store.update_snapshot(meta.id, **fields)
                return self.get(export.tenant, meta.id)
            return self.store.insert_snapshot(
                SnapshotRecord(
                    id=meta.id,
                    tenant=export.tenant,
                    sandbox_id=meta.sandbox_id,
                    parent_snapshot_id=meta.parent_snapshot_id,
                    template=meta.template,
                    vcpus=meta.vcpus,
                    memory_mib=meta.memory_mib,
                    **fields,  # type: ignore[arg-type]
                )
            )

    async def delete(self, tenant: str, snapshot_id: str) -> None:
        """Refused (`in_use`) while a sandbox or another snapshot is built on it."""
        self.get(tenant, snapshot_id)
        sandboxes, snapshots = self.store.snapshot_users(snapshot_id)
        if sandboxes or snapshots:
            users = ", ".join([*sandboxes, *snapshots][:10])
            raise errors.InUse(f"snapshot {snapshot_id} is still used by {users}")
        if task := self._flattening.get(snapshot_id):
            with contextlib.suppress(Exception):
                await asyncio.shield(task)
        shutil.rmtree(self.root / snapshot_id, ignore_errors=True)
        self.store.untag_snapshot(snapshot_id)
        self.store.update_snapshot(snapshot_id, state="deleted")
