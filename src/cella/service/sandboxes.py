"""The sandbox lifecycle: states written before they are acted on, and recovery after a crash.

States: creating -> running <-> (stopping -> stopped -> starting) -> deleting -> deleted, and
error. A transitional state in the store after a restart says exactly what was interrupted,
so `recover()` can finish or undo it: live VMs are adopted, half-made ones are removed, and
no overlay a sandbox still owns is ever deleted.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from cella import errors
from cella.guest.client import ExecEvent, Output
from cella.guest.protocol import ExitStatus
from cella.models import SandboxCreate, SandboxState
from cella.runtime.qemu.driver import DISK, QemuDriver
from cella.runtime.qemu.vm import QemuVM, pid_alive, socket_dir
from cella.server.settings import Settings
from cella.service.egress import SandboxEgress
from cella.service.warm import Shape, WarmPool, WarmSnapshots, new_sandbox_id
from cella.storage.snapshots import SnapshotDir
from cella.store import Store
from cella.telemetry.events import EventLog

log = logging.getLogger("cella.service")
S = SandboxState
# Tail of the output kept in an exec's event (the full output went to the caller).
EVENT_TEXT_LIMIT = 2048


class SandboxService:
    def __init__(self, settings: Settings, store: Store, driver: QemuDriver) -> None:
        self.settings = settings
        self.store = store
        self.driver = driver
        self.warm = WarmSnapshots(driver, settings.boot_timeout)
        self.event_log = EventLog(store)
        self._spans: Any = None
        if settings.otlp_endpoint:
            from cella.telemetry.otel import SpanSink, otlp_http

            self._spans = SpanSink(otlp_http(settings.otlp_endpoint))
            self.event_log.sinks.append(self._spans)
        self.egress = SandboxEgress(settings, store, driver.paths, self.event_log)
        self.pool = WarmPool(
            driver,
            self.warm,
            settings.pool_size,
            egress=self.egress.new_egress,
            prepare=self._prepare_pooled,
        )
        self._vms: dict[str, QemuVM] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._admission = asyncio.Lock()
        self._touched: dict[str, float] = {}
        self._busy: dict[str, int] = {}
        self._reaper: asyncio.Task[None] | None = None
        self._watchers: set[asyncio.Task[None]] = set()

    @property
    def snapshots_dir(self) -> Path:
        return self.driver.paths.root / "snapshots"

    async def start(self) -> None:
        """After recovery: start the egress proxy, make sure the default warm snapshot
        exists and fill the pool."""
        await self.egress.start()
        shape = Shape(self.settings.pool_template, 1, 512)
        await self.warm.ensure(shape)
        self.pool.watch(shape)
        self._reaper = asyncio.create_task(self._reap(), name="cella-reaper")

    def _lock(self, sandbox_id: str) -> asyncio.Lock:
        return self._locks.setdefault(sandbox_id, asyncio.Lock())

    def directory(self, sandbox_id: str) -> Path:
        return self.driver.paths.vms / sandbox_id

    # -- reads ---------------------------------------------------------------------------

    def get(self, tenant: str, sandbox_id: str) -> dict[str, Any]:
        row = self.store.get_sandbox(sandbox_id)
        # another tenant's sandbox is indistinguishable from one that does not exist
        if row is None or row["tenant"] != tenant or row["state"] == S.deleted:
            raise errors.NotFound(f"no sandbox {sandbox_id!r}")
        return row

    def find(
        self, tenant: str, state: str | None = None, labels: dict[str, str] | None = None
    ) -> list[dict[str, Any]]:
        states = [state] if state else [s.value for s in S if s != S.deleted]
        rows = self.store.list_sandboxes(tenant, states)
        if labels:
            rows = [r for r in rows if all(r["labels"].get(k) == v for k, v in labels.items())]
        return rows

    def events(
        self,
        tenant: str,
        sandbox_id: str,
        after: int = 0,
        types: list[str] | None = None,
        limit: int = 1000,
    ) -> list[dict[str, Any]]:
        """A sandbox's events in order (kept after it is deleted: the trace outlives it)."""
        self.owned(tenant, sandbox_id)
        return self.store.events(sandbox_id, after, limit, types)

    def owned(self, tenant: str, sandbox_id: str) -> dict[str, Any]:
        """The tenant's sandbox row, deleted ones included (their traces stay readable)."""
        row = self.store.get_sandbox(sandbox_id)
        if row is None or row["tenant"] != tenant:
            raise errors.NotFound(f"no sandbox {sandbox_id!r}")
        return row

    async def stream_events(
        self,
        tenant: str,
        sandbox_id: str,
        after: int = 0,
        types: list[str] | None = None,
        follow: bool = False,
    ) -> AsyncIterator[dict[str, Any]]:
        """Every event after `after`; with `follow`, then new ones as they happen, until the
        sandbox is deleted (or the reader leaves)."""
        while True:
            batch = self.events(tenant, sandbox_id, after, types)
            for event in batch:
                after = event["id"]
                yield event
            if batch:
                continue
            if not follow:
                return
            row = self.store.get_sandbox(sandbox_id) or {}
            if row.get("state") in (S.deleted, S.error):
                return
            await self.event_log.wait(sandbox_id, 5.0)

    def lineage(self, tenant: str, sandbox_id: str) -> dict[str, Any]:
        """The family tree the sandbox belongs to: from its first ancestor, every snapshot
        and fork made since (sandbox -> snapshot -> sandbox ...)."""
        root = self.owned(tenant, sandbox_id)
        seen = {root.get("id")}
        while root.get("parent_id") and root["parent_id"] not in seen:
            parent = self.store.get_sandbox(root["parent_id"])
            if parent is None or parent["tenant"] != tenant:
                break
            seen.add(parent["id"])
            root = parent
        return self._family(tenant, root)

    def _family(self, tenant: str, row: dict[str, Any]) -> dict[str, Any]:
        node: dict[str, Any] = {
            "kind": "sandbox",
            "id": row["id"],
            "state": row["state"],
            "created_at": row["created_at"],
            "children": [],
        }
        for snap in self.store.list_snapshots(tenant):
            if snap["sandbox_id"] != row["id"]:
                continue
            forks = [
                self._family(tenant, child)
                for child in self.store.list_sandboxes(tenant)
                if child["snapshot_id"] == snap["id"] and child["parent_id"] == row["id"]
            ]
            node["children"].append(
                {
                    "kind": "snapshot",
                    "id": snap["id"],
                    "name": snap["name"],
                    "state": snap["state"],
                    "created_at": snap["created_at"],
                    "children": forks,
                }
            )
        return node

    # -- lifecycle -----------------------------------------------------------------------

    LIVE = (S.creating, S.running, S.paused, S.starting, S.stopping)

    def _admit(self, tenant: str, vcpus: int, memory_mib: int, count: int = 1) -> None:
        """Refuses what would exceed the tenant's quota or over-commit the host.

        Called with the admission lock held, right before the sandbox rows are written, so
        concurrent creates cannot both slip under a limit.
        """
        s = self.settings
        live = self.store.list_sandboxes(None, [x.value for x in self.LIVE])
        mine = sum(1 for r in live if r["tenant"] == tenant)
        if mine + count > s.max_sandboxes_per_tenant:
            raise errors.QuotaExceeded(
                f"tenant {tenant!r} has {mine} live sandboxes; the limit is "
                f"{s.max_sandboxes_per_tenant}"
            )
        pooled = self.pool.committed()
        memory = sum(r["memory_mib"] for r in live) + pooled[1]
        cpus = sum(r["vcpus"] for r in live) + pooled[0]
        if memory + count * memory_mib > s.max_host_memory_mib:
            raise errors.CapacityExceeded(
                f"{count * memory_mib} MiB more would commit {memory + count * memory_mib} of "
                f"the host's {s.max_host_memory_mib} MiB"
            )
        if cpus + count * vcpus > s.max_host_vcpus:
            raise errors.CapacityExceeded(
                f"{count * vcpus} more vCPUs would commit {cpus + count * vcpus} of the "
                f"host's {s.max_host_vcpus}"
            )

    def _check_limits(self, req: SandboxCreate) -> None:
        s = self.settings
        if req.vcpus > s.max_vcpus:
            raise errors.InvalidArgument(f"vcpus must be at most {s.max_vcpus} on this host")
        if req.memory_mib > s.max_memory_mib:
            raise errors.InvalidArgument(
                f"memory_mib must be at most {s.max_memory_mib} on this host"
            )
        if req.disk_mib is not None and req.disk_mib > s.max_disk_mib:
            raise errors.InvalidArgument(f"disk_mib must be at most {s.max_disk_mib}")
        for key, value in req.labels.items():
            if not key or len(key) > 63 or len(value) > 255:
                raise errors.InvalidArgument(f"invalid label {key!r}")

    async def create(self, tenant: str, req: SandboxCreate) -> dict[str, Any]:
        self._check_limits(req)
        from cella.images.templates import find_template

        try:
            base = find_template(self.driver.paths, req.template)
        except errors.NotFound:
            raise errors.InvalidArgument(f"unknown template {req.template!r}") from None
        if req.disk_mib is not None:
            from cella.storage.overlay import image_info

            base_mib = int(image_info(base)["virtual-size"]) // (1 << 20)  # type: ignore[call-overload]
            if req.disk_mib < base_mib:
                raise errors.InvalidArgument(
                    f"disk_mib must be at least the template's {base_mib} MiB"
                )
        shape = Shape(req.template, req.vcpus, req.memory_mib)
        secret_refs = self.egress.bind_secrets(tenant, req.secrets)
        async with self._admission:
            self._admit(tenant, req.vcpus, req.memory_mib)
            vm = self.pool.claim(shape) if req.disk_mib is None else None
            sandbox_id = vm.directory.name if vm is not None and vm.directory else new_sandbox_id()
            self.store.insert_sandbox(
                {
                    "id": sandbox_id,
                    "tenant": tenant,
                    "state": S.creating,
                    "template": req.template,
                    "vcpus": req.vcpus,
                    "memory_mib": req.memory_mib,
                    "disk_mib": req.disk_mib,
                    "ttl_seconds": req.ttl_seconds,
                    "idle_timeout_seconds": req.idle_timeout_seconds,
                    "ttl_action": req.ttl_action,
                    "idle_action": req.idle_action,
                    "max_pids": req.max_pids,
                    "labels": req.labels,
                    "network": req.network.model_dump(),
                    "secrets": secret_refs,
                    "created_from": "pool" if vm is not None else "restore",
                }
            )
        async with self._lock(sandbox_id):
            try:
                if vm is None:  # the pool is empty: restore, never cold-boot
                    snap = await self.warm.ensure(shape)
                    vm = await self._restore(snap, sandbox_id)
                if secret_refs:  # only then is any of its TLS intercepted
                    await self.egress.trust_ca(vm)
                self.egress.attach(vm, self.store.get_sandbox(sandbox_id) or {})
                await self._fresh_identity(vm, sandbox_id, req.max_pids)
                if req.disk_mib is not None:
                    await vm.grow_disk(req.disk_mib)
            except BaseException as exc:
                if vm is not None:
                    await self.driver.destroy(vm)
                message = str(exc) if isinstance(exc, errors.CellaError) else repr(exc)
                self.store.update_sandbox(sandbox_id, state=S.error, error=message[:2000])
                self.event_log.emit(sandbox_id, "create_failed", {"error": message[:2000]})
                raise
            self._running(sandbox_id, vm)
            self.event_log.emit(
                sandbox_id,
                "created",
                {
                    "template": req.template,
                    "from": "pool" if vm.boot_seconds is None else "restore",
                    "restore_ms": round((vm.boot_seconds or 0) * 1000, 1),
                },
            )
        if shape.vcpus == 1 and shape.memory_mib == 512:
            self.pool.watch(shape)
        return self.get(tenant, sandbox_id)

    async def _restore(self, snap: SnapshotDir, sandbox_id: str) -> QemuVM:
        """A VM restored for a sandbox, with its egress forwards (freed when it exits)."""
        vm = await self.driver.restore(
            snap, self.directory(sandbox_id), egress=self.egress.new_egress()
        )
        return self.egress.release_on_exit(vm)

    async def _prepare_pooled(self, vm: QemuVM) -> None:
        self.egress.release_on_exit(vm)

    def _running(self, sandbox_id: str, vm: QemuVM) -> None:
        self._track(sandbox_id, vm)
        self.store.update_sandbox(
            sandbox_id, state=S.running, pid=vm.pid, accel=vm.accel, accel_reason=vm.accel_reason
        )

    def _track(self, sandbox_id: str, vm: QemuVM) -> None:
        """Owns the VM from now on; if it ends without being asked to (QEMU crashed or was
        killed), the sandbox is marked stopped with the reason, its disk kept for resume."""
        self._vms[sandbox_id] = vm
        task = asyncio.create_task(self._watch(sandbox_id, vm), name=f"watch-{sandbox_id}")
        self._watchers.add(task)
        task.add_done_callback(self._watchers.discard)

    async def _watch(self, sandbox_id: str, vm: QemuVM) -> None:
        if vm.process is not None:
            await vm.process.wait()
        else:
            while vm.pid is not None and pid_alive(vm.pid):
                await asyncio.sleep(0.5)
        if self._vms.get(sandbox_id) is not vm:
            return  # stopped, deleted or replaced by us: an expected end
        async with self._lock(sandbox_id):
            if self._vms.get(sandbox_id) is not vm:
                return
            self._vms.pop(sandbox_id)
            reason = await vm._exit_reason() if vm.process is not None else "QEMU ended"
            await vm.kill()  # releases sockets, egress address, CPU cgroup
            shutil.rmtree(socket_dir(self.directory(sandbox_id)), ignore_errors=True)
            message = f"the VM exited unexpectedly ({reason}); its disk is kept: resume it"
            log.warning("%s: %s", sandbox_id, message)
            self.store.update_sandbox(sandbox_id, state=S.stopped, pid=None, error=message)
            self.event_log.emit(sandbox_id, "crashed", {"reason": reason})

    async def _fresh_identity(
        self, vm: QemuVM, sandbox_id: str, max_pids: int | None = None
    ) -> None:
        """A restored guest is a copy: give it its own name, clock, entropy and limits."""
        await vm.agent.set_identity(
            hostname=sandbox_id,
            time_ns=time.time_ns(),
            seed=os.urandom(64),
            sandbox_id=sandbox_id,
            pids_max=max_pids or self.settings.default_max_pids,
        )

    async def stop(self, tenant: str, sandbox_id: str) -> dict[str, Any]:
        """Ends every process; the disk (files, installed packages) stays."""
        async with self._lock(sandbox_id):
            row = self.get(tenant, sandbox_id)
            if row["state"] == S.stopped:
                return row
            if row["state"] not in (S.running, S.paused):
                raise errors.InvalidState(f"cannot stop a sandbox that is {row['state']}")
            self.store.update_sandbox(sandbox_id, state=S.stopping)
            vm = self._vms.pop(sandbox_id, None)
            if vm is not None:
                await vm.stop()
            self.store.update_sandbox(sandbox_id, state=S.stopped, pid=None)
            self.event_log.emit(sandbox_id, "stopped")
        return self.get(tenant, sandbox_id)

    async def pause(self, tenant: str, sandbox_id: str) -> dict[str, Any]:
        """Freezes the VM: no CPU, memory kept; processes go on after `resume`."""
        async with self._lock(sandbox_id):
            row = self.get(tenant, sandbox_id)
            if row["state"] == S.paused:
                return row
            vm = self.vm(tenant, sandbox_id)
            self.store.update_sandbox(sandbox_id, state=S.paused)
            try:
                await vm.pause()
            except BaseException:
                self.store.update_sandbox(sandbox_id, state=S.running)
                raise
            self.event_log.emit(sandbox_id, "paused")
        return self.get(tenant, sandbox_id)

    async def resume(self, tenant: str, sandbox_id: str) -> dict[str, Any]:
        """Paused: the VM runs on. Stopped: boots the same overlay again (files and
        installed packages are still there; processes are not)."""
        async with self._lock(sandbox_id):
            row = self.get(tenant, sandbox_id)
            if row["state"] == S.running:
                return row
            if row["state"] == S.paused:
                vm = self._vms.get(sandbox_id)
                if vm is None:
                    raise errors.InvalidState(f"sandbox {sandbox_id} lost its VM")
                await vm.resume()
                self.store.update_sandbox(sandbox_id, state=S.running)
                self.event_log.emit(sandbox_id, "resumed", {"from": "paused"})
                return self.get(tenant, sandbox_id)
            if row["state"] != S.stopped:
                raise errors.InvalidState(f"cannot resume a sandbox that is {row['state']}")
            self.store.update_sandbox(sandbox_id, state=S.starting)
            try:
                vm = await self.driver.start(
                    self.directory(sandbox_id),
                    vcpus=row["vcpus"],
                    memory_mib=row["memory_mib"],
                    boot_timeout=self.settings.boot_timeout,
                    disk=row["disk"],
                    egress=self.egress.new_egress(),
                )
            except BaseException:
                self.store.update_sandbox(sandbox_id, state=S.stopped, pid=None)
                raise
            self.egress.release_on_exit(vm)
            self.egress.attach(vm, row)
            self._track(sandbox_id, vm)
            self.store.update_sandbox(sandbox_id, state=S.running, pid=vm.pid)
            self.event_log.emit(sandbox_id, "resumed", {"from": "stopped"})
        return self.get(tenant, sandbox_id)

    async def delete(self, tenant: str, sandbox_id: str) -> None:
        async with self._lock(sandbox_id):
            self.get(tenant, sandbox_id)
            self.store.update_sandbox(sandbox_id, state=S.deleting)
            await self._teardown(sandbox_id)
            self.store.update_sandbox(sandbox_id, state=S.deleted, pid=None)
            self.event_log.emit(sandbox_id, "deleted")
        self._locks.pop(sandbox_id, None)

    async def _teardown(self, sandbox_id: str, pid: int | None = None) -> None:
        vm = self._vms.pop(sandbox_id, None)
        if vm is not None:
            await vm.kill()
        for stray in self.driver.stray_qemu_pids(keep=self._live_pids()):
            if f"/{sandbox_id}/" in " ".join(_cmdline(stray)):
                await _kill_pid(stray)
        self.driver.remove_directory(self.directory(sandbox_id))

    def _live_pids(self) -> set[int]:
        return {vm.pid for vm in self._vms.values() if vm.pid is not None}

    async def shutdown(self) -> None:
        """Daemon exit: sandbox VMs keep running and are adopted by the next daemon; pooled
        VMs (not anyone's yet) are destroyed."""
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        await self.pool.close()
        left = list(self._vms.values())
        self._vms.clear()  # watchers now see an expected end
        for task in list(self._watchers):
            task.cancel()
        for vm in left:
            await vm._close_channels()
        await self.egress.close()
        if self._spans is not None:
            self._spans.close()  # flushes what is batched

    # -- snapshots and forks -------------------------------------------------------------

    def get_snapshot(self, tenant: str, snapshot_id: str) -> dict[str, Any]:
        row = self.store.get_snapshot(snapshot_id)
        if row is None or row["tenant"] != tenant or row["state"] == "deleted":
            raise errors.NotFound(f"no snapshot {snapshot_id!r}")
        return row

    def find_snapshots(self, tenant: str) -> list[dict[str, Any]]:
        return self.store.list_snapshots(tenant, ["creating", "ready", "error"])

    async def snapshot(self, tenant: str, sandbox_id: str, name: str) -> dict[str, Any]:
        """Disk and memory of a running sandbox at one instant; it runs on afterwards."""
        async with self._lock(sandbox_id):
            row = self.get(tenant, sandbox_id)
            vm = self.vm(tenant, sandbox_id)
            snapshot_id = f"snap-{os.urandom(8).hex()}"
            self.store.insert_snapshot(
                {
                    "id": snapshot_id,
                    "tenant": tenant,
                    "name": name,
                    "sandbox_id": sandbox_id,
                    "parent_snapshot_id": row["base_snapshot_id"],
                    "state": "creating",
                    "template": row["template"],
                    "vcpus": row["vcpus"],
                    "memory_mib": row["memory_mib"],
                }
            )
            self.snapshots_dir.mkdir(parents=True, exist_ok=True)
            dest = SnapshotDir(self.snapshots_dir / snapshot_id)
            try:
                self._check_space(row)
                manifest, paused = await self.driver.snapshot_vm(
                    vm, dest, template=row["template"], sandbox_id=sandbox_id
                )
            except BaseException as exc:
                if not isinstance(exc, errors.NoSpace) and self._short_of_space(row):
                    exc = errors.NoSpace(f"the data directory ran out of space: {exc}")
                message = str(exc) if isinstance(exc, errors.CellaError) else repr(exc)
                self.store.update_snapshot(snapshot_id, state="error", error=message[:2000])
                raise exc from None
            self.store.update_snapshot(
                snapshot_id,
                state="ready",
                size_bytes=sum(manifest["bytes"].values()),
                paused_ms=round(paused * 1000, 1),
            )
            self.event_log.emit(
                sandbox_id,
                "snapshot",
                {"snapshot_id": snapshot_id, "name": name, "paused_ms": round(paused * 1000, 1)},
            )
        return self.get_snapshot(tenant, snapshot_id)

    def _snapshot_needs(self, row: dict[str, Any]) -> int:
        """Bytes a snapshot of this sandbox may take at most: all of its RAM, its overlay."""
        overlay = sum(p.stat().st_blocks * 512 for p in self.directory(row["id"]).glob("*.qcow2"))
        return int(row["memory_mib"]) * (1 << 20) + overlay

    def _short_of_space(self, row: dict[str, Any]) -> bool:
        """A failed snapshot that could not have fit (what it wrote is already removed)."""
        return shutil.disk_usage(self.snapshots_dir).free < self._snapshot_needs(row)

    def _check_space(self, row: dict[str, Any]) -> None:
        free = shutil.disk_usage(self.snapshots_dir).free
        if free < self._snapshot_needs(row):
            raise errors.NoSpace(
                f"a snapshot of {row['id']} may need {self._snapshot_needs(row) >> 20} MiB; "
                f"{self.snapshots_dir} has {free >> 20} MiB free"
            )

    async def fork_snapshot(
        self, tenant: str, snapshot_id: str, count: int
    ) -> list[dict[str, Any]]:
        """`count` new sandboxes restored from the snapshot, each on its own overlay."""
        snap_row = self.get_snapshot(tenant, snapshot_id)
        if snap_row["state"] != "ready":
            raise errors.InvalidState(f"snapshot {snapshot_id} is {snap_row['state']}")
        snap = SnapshotDir(self.snapshots_dir / snapshot_id)
        snap.verify()  # refuse a corrupted snapshot before creating anything
        async with self._admission:
            self._admit(tenant, snap_row["vcpus"], snap_row["memory_mib"], count)
            ids = [new_sandbox_id() for _ in range(count)]
            for sandbox_id in ids:
                self._insert_fork_row(tenant, snap_row, sandbox_id)
        gate = asyncio.Semaphore(4)

        async def one(sandbox_id: str) -> str:
            async with gate:
                return await self._restore_fork(snap_row, snap, sandbox_id)

        results = await asyncio.gather(*(one(i) for i in ids), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            for result in results:
                if isinstance(result, str):
                    await self.delete(tenant, result)
            raise failed[0]
        return [self.get(tenant, i) for i in ids]

    def _insert_fork_row(self, tenant: str, snap_row: dict[str, Any], sandbox_id: str) -> None:
        source = self.store.get_sandbox(snap_row["sandbox_id"]) or {}
        self.store.insert_sandbox(
            {
                "id": sandbox_id,
                "tenant": tenant,
                "state": S.creating,
                "template": snap_row["template"],
                "vcpus": snap_row["vcpus"],
                "memory_mib": snap_row["memory_mib"],
                "disk_mib": source.get("disk_mib"),
                "ttl_seconds": source.get("ttl_seconds"),
                "idle_timeout_seconds": source.get("idle_timeout_seconds"),
                "ttl_action": source.get("ttl_action", "delete"),
                "idle_action": source.get("idle_action", "stop"),
                "max_pids": source.get("max_pids"),
                "labels": source.get("labels", {}),
                "network": source.get("network", {"allow": [], "deny": []}),
                "secrets": source.get("secrets", {}),
                "parent_id": snap_row["sandbox_id"],
                "snapshot_id": snap_row["id"],
                "base_snapshot_id": snap_row["id"],
                "created_from": "fork",
            }
        )

    async def _restore_fork(
        self, snap_row: dict[str, Any], snap: SnapshotDir, sandbox_id: str
    ) -> str:
        async with self._lock(sandbox_id):
            vm = None
            try:
                vm = await self._restore(snap, sandbox_id)
                row = self.store.get_sandbox(sandbox_id) or {}
                self.egress.attach(vm, row)  # the parent's policy and placeholders
                await self._fresh_identity(vm, sandbox_id, row.get("max_pids"))
            except BaseException as exc:
                if vm is not None:
                    await self.driver.destroy(vm)
                self.driver.remove_directory(self.directory(sandbox_id))
                self.store.update_sandbox(sandbox_id, state=S.error, error=str(exc)[:2000])
                raise
            self._running(sandbox_id, vm)
            self.event_log.emit(
                sandbox_id,
                "forked",
                {
                    "parent_id": snap_row["sandbox_id"],
                    "snapshot_id": snap_row["id"],
                    "restore_ms": round((vm.boot_seconds or 0) * 1000, 1),
                },
            )
        return sandbox_id

    async def fork(self, tenant: str, sandbox_id: str, count: int) -> list[dict[str, Any]]:
        """Snapshots a running sandbox once, then restores `count` branches from it."""
        snap = await self.snapshot(tenant, sandbox_id, f"fork of {sandbox_id}")
        return await self.fork_snapshot(tenant, snap["id"], count)

    async def delete_snapshot(self, tenant: str, snapshot_id: str) -> None:
        self.get_snapshot(tenant, snapshot_id)
        sandboxes, snapshots = self.store.snapshot_users(snapshot_id)
        if sandboxes or snapshots:
            users = ", ".join([*sandboxes, *snapshots][:10])
            raise errors.InUse(f"snapshot {snapshot_id} is still used by {users}")
        shutil.rmtree(self.snapshots_dir / snapshot_id, ignore_errors=True)
        self.store.update_snapshot(snapshot_id, state="deleted")

    # -- egress ------------------------------------------------------------------------

    def set_network(self, tenant: str, sandbox_id: str, policy: dict[str, Any]) -> dict[str, Any]:
        """Changes where a sandbox may connect; a running one gets it for its next connection."""
        row = self.get(tenant, sandbox_id)
        self.store.update_sandbox(sandbox_id, network=policy)
        row = self.get(tenant, sandbox_id)
        vm = self._vms.get(sandbox_id)
        if vm is not None:
            self.egress.attach(vm, row)
        self.event_log.emit(sandbox_id, "network_changed", policy)
        return row

    def egress_log(
        self, tenant: str, sandbox_id: str, after: int = 0, limit: int = 1000
    ) -> list[dict[str, Any]]:
        self.owned(tenant, sandbox_id)
        rows = self.store.events(sandbox_id, after, limit, ["egress"])
        return [{"id": r["id"], "at": r["at"], **r["data"]} for r in rows]

    def put_secret(self, tenant: str, name: str, fields: dict[str, Any]) -> dict[str, Any]:
        """Stores a secret; running sandboxes that use it get the new value at once."""
        secret = self.egress.put_secret(tenant, name, fields)
        for row in self.find(tenant):
            vm = self._vms.get(row["id"])
            if vm is not None and any(r["secret"] == name for r in row["secrets"].values()):
                self.egress.attach(vm, row)
        return secret

    # -- usage -------------------------------------------------------------------------

    async def usage(self, tenant: str, sandbox_id: str) -> dict[str, Any]:
        row = self.get(tenant, sandbox_id)
        directory = self.directory(sandbox_id)
        allocated = sum(p.stat().st_blocks * 512 for p in directory.glob("*.qcow2"))
        out: dict[str, Any] = {
            k: row[k]
            for k in (
                "id",
                "state",
                "vcpus",
                "memory_mib",
                "disk_mib",
                "max_pids",
                "ttl_seconds",
                "idle_timeout_seconds",
            )
        }
        out["ttl_remaining_seconds"] = (
            max(0.0, row["ttl_seconds"] - (time.time() - _epoch(row["created_at"])))
            if row["ttl_seconds"]
            else None
        )
        out["disk_allocated_mib"] = round(allocated / (1 << 20), 2)
        vm = self._vms.get(sandbox_id)
        if vm is None or vm.pid is None:
            return out
        out["cpu_seconds"] = self.driver.cpu.cpu_seconds(vm.config.name) or _proc_cpu(vm.pid)
        out["host_memory_mib"] = _pss_mib(vm.pid)
        if row["state"] != S.running:
            return out
        meminfo = (await vm.agent.read_file("/proc/meminfo")).decode()
        fields = {ln.split(":")[0]: int(ln.split()[1]) for ln in meminfo.splitlines() if ":" in ln}
        out["guest_memory_total_mib"] = round(fields["MemTotal"] / 1024, 1)
        out["guest_memory_used_mib"] = round(
            (fields["MemTotal"] - fields["MemAvailable"]) / 1024, 1
        )
        df = await vm.agent.exec(["stat", "-f", "-c", "%S %b %f", "/"], timeout=30)
        if df.exit_code == 0:
            size, blocks, free = (int(x) for x in df.stdout.split())
            out["guest_disk_total_mib"] = round(size * blocks / (1 << 20), 1)
            out["guest_disk_used_mib"] = round(size * (blocks - free) / (1 << 20), 1)
        with contextlib.suppress(errors.CellaError):
            pids = await vm.agent.read_file("/sys/fs/cgroup/cella/pids.current")
            out["pids"] = int(pids)
        return out

    # -- exec and files -----------------------------------------------------------------

    def vm(self, tenant: str, sandbox_id: str) -> QemuVM:
        """The running VM of a sandbox, for exec and file operations (which are activity)."""
        return self._live(tenant, sandbox_id)[1]

    def _live(self, tenant: str, sandbox_id: str) -> tuple[dict[str, Any], QemuVM]:
        row = self.get(tenant, sandbox_id)
        vm = self._vms.get(sandbox_id)
        if row["state"] != S.running or vm is None:
            raise errors.InvalidState(f"sandbox {sandbox_id} is {row['state']}, not running")
        self._touch(sandbox_id)
        return row, vm

    def _touch(self, sandbox_id: str) -> None:
        now = time.time()
        if now - self._touched.get(sandbox_id, 0.0) >= 1.0:  # at most one write a second
            self._touched[sandbox_id] = now
            self.store.update_sandbox(sandbox_id, last_active_at=_iso(now))

    async def _reap(self) -> None:
        """Enforces TTLs and idle timeouts from the store, so it picks up after a restart."""
        while True:
            try:
                await self._reap_once()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("reaper pass failed")
            await asyncio.sleep(self.settings.reaper_interval)

    async def _reap_once(self) -> None:
        now = time.time()
        for row in self.store.list_sandboxes(None, [S.running, S.paused, S.stopped]):
            sid, state = row["id"], row["state"]
            created = _epoch(row["created_at"])
            if row["ttl_seconds"] and now - created >= row["ttl_seconds"]:
                action = row["ttl_action"]
                if state == S.stopped and action != "delete":
                    continue
                if state == S.paused and action == "pause":
                    continue
                await self._expire(row, "ttl", action)
            elif (
                row["idle_timeout_seconds"]
                and state == S.running
                and not self._busy.get(sid)
                and now - _epoch(row["last_active_at"] or row["created_at"])
                >= row["idle_timeout_seconds"]
            ):
                await self._expire(row, "idle", row["idle_action"])

    async def _expire(self, row: dict[str, Any], limit: str, action: str) -> None:
        self.event_log.emit(row["id"], "limit_hit", {"limit": limit, "action": action})
        log.info("%s of %s expired: %s", limit, row["id"], action)
        with contextlib.suppress(errors.NotFound, errors.InvalidState):
            if action == "delete":
                await self.delete(row["tenant"], row["id"])
            elif action == "pause":
                await self.pause(row["tenant"], row["id"])
            else:
                await self.stop(row["tenant"], row["id"])

    async def exec_stream(
        self, tenant: str, sandbox_id: str, command: list[str] | str, **kwargs: Any
    ) -> AsyncIterator[ExecEvent]:
        row, vm = self._live(tenant, sandbox_id)  # one store read on the exec path
        kwargs["env"] = {**self.egress.guest_env(row), **(kwargs.get("env") or {})}
        self._busy[sandbox_id] = self._busy.get(sandbox_id, 0) + 1
        started_at = time.time()
        start = time.monotonic()
        out_len = err_len = 0
        digest = hashlib.sha256()
        tail = bytearray()
        status: ExitStatus | None = None
        try:
            async for event in vm.agent.exec_stream(command, **kwargs):
                if isinstance(event, Output):
                    if event.stream == "stdout":
                        out_len += len(event.data)
                    else:
                        err_len += len(event.data)
                    digest.update(event.data)
                    tail.extend(event.data)
                    del tail[:-EVENT_TEXT_LIMIT]
                elif isinstance(event, ExitStatus):
                    status = event
                yield event
        finally:
            self._busy[sandbox_id] -= 1
            self._touched.pop(sandbox_id, None)
            self._touch(sandbox_id)
            self.event_log.emit(
                sandbox_id,
                "exec",
                {
                    "command": command,
                    "cwd": kwargs.get("cwd"),
                    "started_at": _iso(started_at),
                    "ended_at": _iso(time.time()),
                    "exit_code": status.exit_code if status else None,
                    "timed_out": status.timed_out if status else None,
                    "duration_ms": round((time.monotonic() - start) * 1000, 1),
                    "stdout_bytes": out_len,
                    "stderr_bytes": err_len,
                    "output_sha256": digest.hexdigest(),
                    "output_tail": tail.decode("utf-8", "replace"),
                },
            )

    # -- recovery ------------------------------------------------------------------------

    async def recover(self) -> dict[str, int]:
        """Brings every sandbox to a true state after a daemon restart (or crash)."""
        counts = {"adopted": 0, "stopped": 0, "cleaned": 0, "strays_killed": 0}
        for row in self.store.list_sandboxes(None, [s.value for s in S if s != S.deleted]):
            sid, state, pid = row["id"], row["state"], row["pid"]
            directory = self.directory(sid)
            if state in (S.creating, S.deleting):
                # half-made or half-removed: nothing the user can rely on; free it all
                await self._teardown(sid)
                final = S.deleted if state == S.deleting else S.error
                self.store.update_sandbox(
                    sid,
                    state=final,
                    pid=None,
                    error=None if final == S.deleted else "interrupted while being created",
                )
                self.event_log.emit(sid, "recovered", {"from": state, "to": final})
                counts["cleaned"] += 1
            elif state in (S.running, S.paused, S.starting, S.stopping):
                vm = None
                if pid and state != S.stopping:
                    with contextlib.suppress(errors.CellaError, OSError, TimeoutError):
                        vm = await self.driver.adopt(directory, pid, paused=state == S.paused)
                if vm is not None:
                    self._track(sid, vm)
                    self.egress.release_on_exit(vm)
                    self.egress.attach(vm, row)
                    self.store.update_sandbox(
                        sid, state=S.paused if state == S.paused else S.running
                    )
                    self.event_log.emit(sid, "adopted", {"pid": pid})
                    counts["adopted"] += 1
                else:
                    if pid:
                        await _kill_pid(pid, only_if_contains=str(directory / DISK))
                    shutil.rmtree(socket_dir(directory), ignore_errors=True)
                    self.store.update_sandbox(sid, state=S.stopped, pid=None)
                    self.event_log.emit(sid, "recovered", {"from": state, "to": S.stopped})
                    counts["stopped"] += 1
        # QEMU processes of this data directory that no sandbox owns
        for stray in self.driver.stray_qemu_pids(keep=self._live_pids()):
            await _kill_pid(stray)
            counts["strays_killed"] += 1
        # directories of sandboxes that no longer exist
        live = {
            r["id"]
            for r in self.store.list_sandboxes(None)
            if r["state"] not in (S.deleted, S.error)
        }
        if self.driver.paths.vms.exists():
            for entry in self.driver.paths.vms.iterdir():
                if entry.name not in live:
                    self.driver.remove_directory(entry)
        # snapshots interrupted while being made; their scratch directories
        for snap in self.store.list_snapshots(None, ["creating"]):
            users = self.store.snapshot_users(snap["id"])
            path = self.snapshots_dir / snap["id"]
            if not any(users):
                shutil.rmtree(path, ignore_errors=True)
            self.store.update_snapshot(snap["id"], state="error", error="daemon restarted")
        if self.snapshots_dir.exists():
            for entry in self.snapshots_dir.iterdir():
                if entry.name.startswith("."):
                    shutil.rmtree(entry, ignore_errors=True)
        log.info("recovery: %s", counts)
        return counts


def _cmdline(pid: int) -> list[str]:
    from cella.runtime.qemu.vm import qemu_cmdline

    return qemu_cmdline(pid)


async def _kill_pid(pid: int, only_if_contains: str | None = None) -> None:
    import os
    import signal

    from cella.runtime.qemu.vm import pid_alive

    if only_if_contains is not None and only_if_contains not in " ".join(_cmdline(pid)):
        return  # the pid was reused by something else
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    for _ in range(250):
        if not pid_alive(pid):
            return
        await asyncio.sleep(0.02)


def _iso(epoch: float) -> str:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(epoch, UTC).isoformat()


def _epoch(iso: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(iso).timestamp()


def _proc_cpu(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None
