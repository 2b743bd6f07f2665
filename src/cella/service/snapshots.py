"""Snapshots: a running sandbox's disk and memory saved at one instant.

Owns snapshot rows and directories (`DATA_DIR/snapshots/<id>`), their names and tags (a
tag points at one snapshot of a name and moves, as Docker's do; `name:tag`, a bare name or
an id resolve to a snapshot), the free-space check before a snapshot and the `no_space`
answer when the disk fills during one, and the refcount that keeps a snapshot while
sandboxes or snapshots are built on it. Sandboxes restored from a snapshot are `forks`;
snapshots moving between nodes are `shipping`.

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
from cella.models import SandboxCreate, SandboxState, SnapshotState
from cella.policy.access import Permission, Principal
from cella.runtime.contract import VM
from cella.service.registry import Registry, error_text
from cella.service.sandbox_rows import spec_of
from cella.storage.snapshots import SnapshotDir
from cella.store import SandboxRecord, SecretRef, SnapshotRecord

log = logging.getLogger("cella.snapshots")


class Snapshots:
    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.store = registry.store
        self.driver = registry.driver
        self.events = registry.events
        self._flattening: dict[str, asyncio.Task[None]] = {}
        # awaited with a snapshot's id as it is deleted (what was kept ready for it goes)
        self.deleted_hooks: list[Callable[[str], Awaitable[None]]] = []

    @property
    def root(self) -> Path:
        return self.driver.paths.root / "snapshots"

    def directory(self, snapshot_id: str) -> SnapshotDir:
        return SnapshotDir(self.root / snapshot_id)

    def get(self, tenant: str, snapshot_id: str) -> SnapshotRecord:
        row = self.store.get_snapshot(snapshot_id)
        if row is None or row.tenant != tenant or row.state == SnapshotState.deleted:
            raise errors.NotFound(f"no snapshot {snapshot_id!r}")
        return row

    def creating_disk(self, row: SandboxRecord, name: str) -> SnapshotRecord:
        """The row of a snapshot of `row`'s disk alone (no memory), being made."""
        return self.store.insert_snapshot(
            SnapshotRecord(
                id=f"snap-{os.urandom(8).hex()}",
                tenant=row.tenant,
                name=name,
                sandbox_id=row.id,
                parent_snapshot_id=row.base_snapshot_id,
                state=SnapshotState.creating,
                template=row.template,
                vcpus=row.vcpus,
                memory_mib=row.memory_mib,
                memory=False,
            )
        )

    async def copy_disk(self, row: SandboxRecord, record: SnapshotRecord) -> SnapshotRecord:
        """`row`'s disk files as they are into `record` (`creating_disk`'s): nothing may
        write them meanwhile (the sandbox stopped, or its disk split), its lock held by the
        caller."""
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            manifest = await self.driver.snapshot_stopped(
                self.registry.directory(row.id),
                self.directory(record.id),
                vcpus=row.vcpus,
                memory_mib=row.memory_mib,
                template=row.template,
                sandbox_id=row.id,
            )
        except BaseException as exc:
            self.store.update_snapshot(record.id, state="error", error=error_text(exc))
            raise
        size = sum(manifest["bytes"].values())
        self.store.update_snapshot(record.id, state="ready", size_bytes=size, paused_ms=0.0)
        return self.get(row.tenant, record.id)

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

    def ready(self, snapshot_id: str) -> SnapshotRecord:
        """A ready snapshot of any tenant (nodes of a fleet ask for one by id)."""
        row = self.store.get_snapshot(snapshot_id)
        if row is None or row.state == SnapshotState.deleted:
            raise errors.NotFound(f"no snapshot {snapshot_id!r}")
        if row.state != SnapshotState.ready:
            raise errors.InvalidState(f"snapshot {snapshot_id} is {row.state}")
        return row

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

    def begin(self, tenant: str, name: str, template: str) -> SnapshotRecord:
        """A snapshot row that is `creating` while its sandbox is still to be made (one
        built from an image); `snapshot(..., into=)` fills it in."""
        return self.store.insert_snapshot(
            SnapshotRecord(
                id=f"snap-{os.urandom(8).hex()}",
                tenant=tenant,
                name=name,
                sandbox_id="",
                state=SnapshotState.creating,
                template=template,
                vcpus=0,
                memory_mib=0,
            )
        )

    async def snapshot(
        self,
        who: Principal,
        sandbox_id: str,
        name: str,
        tag: str | None = None,
        into: SnapshotRecord | None = None,
        *,
        memory: bool = True,
        standalone: bool = False,
        leave_paused: bool = False,
        activity: bool = True,
        held: bool = False,
        flatten: bool = True,
        paused_too: bool = False,
    ) -> SnapshotRecord:
        """Disk and memory of a running sandbox at one instant (`memory=False`: its disk
        alone, which sandboxes boot from); it runs on afterwards. With `tag`, `name:tag`
        points at it once it is ready; with `into`, the snapshot is that row (made by
        `begin`); `standalone`: its disk is made one file of its own before it is ready
        (nothing of this node's images under it); `leave_paused`: the VM stays paused after
        (a move ships it as it was then); `activity=False`: the daemon's own copy (a fleet's
        replica), which keeps no sandbox from going idle; `held`: the caller holds the
        sandbox's lock already (a move's pre-copy); `flatten=False`: a RAM layer stays one
        (a move ships it as such); `paused_too`: a paused sandbox is copied as well (its
        guest runs for the sync, then is frozen again at the snapshot's instant; its row
        stays paused). Whoever may exec in the sandbox may copy it; the snapshot is its
        tenant's, as every snapshot is."""
        lock = contextlib.nullcontext() if held else self.registry.lock(sandbox_id)
        async with lock:
            row, vm, frozen = await self._live(who, sandbox_id, activity, paused_too)
            leave_paused = leave_paused or frozen
            tenant = row.tenant
            fields = {
                "sandbox_id": sandbox_id,
                "parent_snapshot_id": row.base_snapshot_id,
                "template": row.template,
                "vcpus": row.vcpus,
                "memory_mib": row.memory_mib,
                "memory": memory,
            }
            if into is None:
                record = self.store.insert_snapshot(
                    SnapshotRecord(
                        id=f"snap-{os.urandom(8).hex()}",
                        tenant=tenant,
                        name=name,
                        state=SnapshotState.creating,
                        **fields,  # type: ignore[arg-type]
                    )
                )
            else:
                self.store.update_snapshot(into.id, **fields)
                record = self.get(tenant, into.id)
            self.root.mkdir(parents=True, exist_ok=True)
            dest = self.directory(record.id)
            try:
                self._check_space(row)
                manifest, paused = await self.driver.snapshot_vm(
                    vm,
                    dest,
                    memory=memory,
                    leave_paused=leave_paused,
                    template=row.template,
                    sandbox_id=sandbox_id,
                )
                if standalone:
                    manifest = await asyncio.to_thread(dest.stand_alone)
            except BaseException as exc:
                if frozen:  # paused it was, and stays
                    with contextlib.suppress(errors.CellaError):
                        await vm.pause()
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
            if flatten and dest.is_layered(manifest):
                self._flatten_soon(record.id)
            if tag:
                self.store.set_tag(tenant, name, tag, record.id)
            self.events.emit(
                sandbox_id,
                "snapshot",
                {
                    "snapshot_id": record.id,
                    "name": name,
                    "tag": tag,
                    "memory": memory,
                    "paused_ms": paused_ms,
                },
            )
        return self.get(who.tenant, record.id)

    async def _live(
        self, who: Principal, sandbox_id: str, activity: bool, paused_too: bool
    ) -> tuple[SandboxRecord, VM, bool]:
        """The sandbox's VM to snapshot, running; and whether it was paused (then resumed
        here for the snapshot, to be left paused by it). Its lock is held."""
        row = self.registry.get(who, sandbox_id, Permission.exec)
        vm = self.registry.vm(sandbox_id)
        if paused_too and row.state == SandboxState.paused and vm is not None:
            await vm.resume()  # the guest syncs its files; no state change, no event
            return row, vm, True
        row, vm = self.registry.live(who, sandbox_id, activity=activity)
        return row, vm, False

    def memory_bytes(self, snapshot_id: str) -> int | None:
        """What the snapshot's memory takes on this node; None when it has none (or its
        files are not here)."""
        snap = self.directory(snapshot_id)
        if not snap.exists():
            return None
        with contextlib.suppress(errors.SnapshotCorrupt):
            return snap.memory_bytes()
        return None

    def disk_mib(self, snapshot_id: str) -> int:
        """The size of the snapshot's disk in MiB (`NotFound` when its files are not here)."""
        return self.directory(snapshot_id).disk_mib()

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

    def _flatten_soon(self, snapshot_id: str) -> None:
        if snapshot_id not in self._flattening:
            task = asyncio.create_task(self._flatten(snapshot_id), name=f"flatten-{snapshot_id}")
            self._flattening[snapshot_id] = task
            task.add_done_callback(lambda _: self._flattening.pop(snapshot_id, None))

    async def _flatten(self, snapshot_id: str) -> None:
        try:
            manifest = await self.driver.flatten(self.directory(snapshot_id))
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
            if (snap := self.directory(row.id)).exists() and snap.is_layered()
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
        snap = self.directory(snapshot_id)
        if snap.exists() and snap.is_layered():
            self._flatten_soon(snapshot_id)
        if task := self._flattening.get(snapshot_id):
            await asyncio.shield(task)
        if snap.exists() and snap.is_layered():
            raise errors.SnapshotCorrupt(f"snapshot {snapshot_id} could not be flattened")

    def source_of(self, snap: SnapshotRecord) -> tuple[SandboxCreate, dict[str, SecretRef]]:
        """How the snapshot's sandbox was made, and the secrets its memory holds
        placeholders of: from its row, or kept with a snapshot taken in from another node."""
        kept = self.directory(snap.id).source_path
        if kept.exists():
            data = json.loads(kept.read_text())
            secrets = {k: SecretRef(**v) for k, v in data["secrets"].items()}
            return SandboxCreate.model_validate(data["spec"]), secrets
        source = self.store.get_sandbox(snap.sandbox_id)
        if source is None:
            raise errors.NotFound(f"the source of snapshot {snap.id} is gone")
        return spec_of(source), source.secrets

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
        for hook in self.deleted_hooks:
            await hook(snapshot_id)
        shutil.rmtree(self.root / snapshot_id, ignore_errors=True)
        self.store.untag_snapshot(snapshot_id)
        self.store.update_snapshot(snapshot_id, state="deleted")
