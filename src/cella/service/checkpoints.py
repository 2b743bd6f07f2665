"""Checkpoints: snapshots kept with their sandbox under names of its own; the file changes
between two of them (or one and now); and rewinding the sandbox in place to one.

A checkpoint is an ordinary snapshot (`service.snapshots`: disk and memory; of a restored
VM, only the pages it wrote since) whose row names the checkpoint, so its refcount, its
checksums and its flattening are a snapshot's. A diff reads the two frozen disks on the
host (`storage.fsdiff`); "now" is a disk-only copy taken for the diff and dropped after.
A rewind kills the sandbox's VM and restores the checkpoint into the same sandbox (same
id, files and memory as they were); the sandbox then sits on that checkpoint, and every
checkpoint, later ones too, is kept. A sandbox made with `checkpoint_each_exec` gets one
after each command (`after_exec`, called by `service.exec`). A deleted sandbox's
checkpoints go with it (in the background), but for one another sandbox or snapshot is
built on (a fork of it), which stays an ordinary snapshot.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections import defaultdict

from cella import errors
from cella.models import SandboxState, SnapshotState
from cella.models.checkpoints import NOW
from cella.policy.access import Permission, Principal
from cella.service.background import Background
from cella.service.lifecycle import MANAGE, Lifecycle
from cella.service.registry import Registry
from cella.service.snapshots import Snapshots
from cella.storage import fsdiff
from cella.storage.snapshots import SnapshotDir
from cella.store import SandboxRecord, SnapshotRecord


class Checkpoints:
    def __init__(
        self,
        registry: Registry,
        lifecycle: Lifecycle,
        snapshots: Snapshots,
        background: Background,
    ) -> None:
        self.registry = registry
        self.background = background
        self.store = registry.store
        self.driver = registry.driver
        self.events = registry.events
        self.lifecycle = lifecycle
        self.snapshots = snapshots
        # one checkpoint or rewind of a sandbox at a time (names are unique per sandbox)
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)

    def _of(self, row: SandboxRecord) -> list[SnapshotRecord]:
        snaps = self.store.list_snapshots(row.tenant, ["creating", "ready"])
        return [s for s in snaps if s.sandbox_id == row.id and s.checkpoint is not None]

    def find(self, who: Principal, sandbox_id: str) -> list[SnapshotRecord]:
        """The sandbox's checkpoints that are ready, oldest first."""
        row = self.registry.get(who, sandbox_id)
        return [s for s in self._of(row) if s.state == SnapshotState.ready]

    def get(self, who: Principal, sandbox_id: str, ref: str) -> SnapshotRecord:
        """One of the sandbox's checkpoints, by name or id."""
        for snap in reversed(self.find(who, sandbox_id)):
            if ref in (snap.checkpoint, snap.id):
                return snap
        raise errors.NotFound(f"sandbox {sandbox_id} has no checkpoint {ref!r}")

    async def checkpoint(
        self, who: Principal, sandbox_id: str, name: str | None = None, **data: object
    ) -> SnapshotRecord:
        """Disk and memory of the running sandbox, kept with it as `name` (default
        `cp-<n>`); whoever may exec in it may take one."""
        async with self._locks[sandbox_id]:
            row = self.registry.get(who, sandbox_id, Permission.exec)
            taken = {s.checkpoint for s in self._of(row)}
            if name is None:
                n = len(taken) + 1
                while f"cp-{n}" in taken:
                    n += 1
                name = f"cp-{n}"
            elif name in taken:
                raise errors.AlreadyExists(f"sandbox {sandbox_id} has a checkpoint {name!r}")
            record = self.snapshots.begin(row.tenant, f"{sandbox_id}@{name}", row.template)
            self.store.update_snapshot(record.id, checkpoint=name)  # before it exists
            try:
                snap = await self.snapshots.snapshot(who, sandbox_id, record.name, into=record)
            except BaseException:
                self.store.update_snapshot(record.id, state=SnapshotState.deleted)
                raise
            self.events.emit(
                sandbox_id,
                "checkpoint",
                {"name": name, "snapshot_id": snap.id, "paused_ms": snap.paused_ms, **data},
            )
            return snap

    async def after_exec(self, who: Principal, row: SandboxRecord, command: object) -> None:
        """The checkpoint a `checkpoint_each_exec` sandbox takes after a command (named
        `exec-<n>`: the sandbox's n-th); one that fails is an event, the command's result
        stands."""
        if not row.checkpoint_each_exec:
            return
        n = sum(1 for s in self._of(row) if (s.checkpoint or "").startswith("exec-")) + 1
        try:
            await self.checkpoint(who, row.id, f"exec-{n}", command=command)
        except errors.CellaError as exc:  # the command ran all the same: said, not raised
            self.events.emit(
                row.id, "checkpoint_failed", {"name": f"exec-{n}", "error": exc.message}
            )

    async def rewind(self, who: Principal, sandbox_id: str, ref: str) -> SandboxRecord:
        """The sandbox as it was at the checkpoint: its VM is replaced by one restored from
        it (same id, files and memory then; every checkpoint is kept). A caller who may
        manage the sandbox may rewind it."""
        async with self._locks[sandbox_id]:
            snap = self.get(who, sandbox_id, ref)
            directory = self.snapshots.directory(snap.id)
            await asyncio.to_thread(directory.verify)  # a corrupt one is refused first
            started = time.monotonic()
            async with self.registry.lock(sandbox_id):
                row, _ = self.registry.live(who, sandbox_id, need=MANAGE)
                self.registry.update(sandbox_id, state=SandboxState.starting)
                try:
                    await self.lifecycle.teardown(sandbox_id)
                    vm = await self.lifecycle.restore_vm(directory, sandbox_id)
                except BaseException as exc:
                    self.registry.fail(sandbox_id, exc)
                    raise
                try:  # the guest trusts what it trusted then: its egress and a fresh identity
                    self.lifecycle.egress.attach(vm, row)
                    await vm.agent.set_identity(
                        hostname=row.id,
                        time_ns=time.time_ns(),
                        seed=os.urandom(64),
                        sandbox_id=row.id,
                        pids_max=row.max_pids or self.lifecycle.settings.default_max_pids,
                    )
                    await self.lifecycle.exec_policies.apply(vm, row)  # today's, not then's
                except BaseException as exc:
                    await self.driver.destroy(vm)
                    self.registry.fail(sandbox_id, exc)
                    raise
                self.registry.update(sandbox_id, base_snapshot_id=snap.id)
                self.lifecycle.running(sandbox_id, vm)
            self.events.emit(
                sandbox_id,
                "rewound",
                {
                    "checkpoint": snap.checkpoint,
                    "snapshot_id": snap.id,
                    "rewind_ms": round((time.monotonic() - started) * 1000, 1),
                },
            )
        return self.registry.get(who, sandbox_id)

    def forget(self, sandbox_id: str) -> None:
        """A deleted sandbox's checkpoints are deleted after it."""
        self._locks.pop(sandbox_id, None)
        row = self.store.get_sandbox(sandbox_id)
        if row is not None:
            self.background.start(self._drop(row), name=f"drop-checkpoints-{sandbox_id}")

    async def _drop(self, row: SandboxRecord) -> None:
        for snap in sorted(self._of(row), key=lambda s: s.created_at, reverse=True):
            try:  # newest first: a later one may sit on an earlier one
                await self.snapshots.delete(row.tenant, snap.id)
            except errors.InUse:  # a fork sits on it: it stays, as a snapshot
                continue

    async def diff(
        self, who: Principal, sandbox_id: str, a: str, b: str = NOW
    ) -> tuple[list[fsdiff.Change], bool]:
        """Paths added, removed and modified from checkpoint `a` to checkpoint `b` (or to
        the sandbox as it is now), and whether the list was cut at its bound."""
        row = self.registry.get(who, sandbox_id)
        disk_a = self.snapshots.directory(self.get(who, sandbox_id, a).id).disk
        work = self.snapshots.root / f".diff-{os.urandom(6).hex()}"
        now: SnapshotDir | None = None
        try:
            if b == NOW:
                now = SnapshotDir(work / "now")
                work.mkdir(parents=True)
                async with self.registry.lock(sandbox_id):
                    _, vm = self.registry.live(who, sandbox_id)
                    await self.driver.snapshot_vm(
                        vm, now, memory=False, template=row.template, sandbox_id=sandbox_id
                    )
                disk_b = now.disk
            else:
                disk_b = self.snapshots.directory(self.get(who, sandbox_id, b).id).disk
            return await fsdiff.diff_disks(disk_a, disk_b, work / "views")
        finally:
            shutil.rmtree(work, ignore_errors=True)
