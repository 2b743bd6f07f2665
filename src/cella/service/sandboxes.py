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
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from cella import errors
from cella.guest.client import ExecEvent, Output
from cella.guest.protocol import ExitStatus
from cella.models import SandboxCreate, SandboxState
from cella.runtime.qemu.driver import DISK, QemuDriver
from cella.runtime.qemu.vm import QemuVM
from cella.server.settings import Settings
from cella.store import Store

log = logging.getLogger("cella.service")
S = SandboxState
# Tail of the output kept in an exec's event (the full output went to the caller).
EVENT_TEXT_LIMIT = 2048


class SandboxService:
    def __init__(self, settings: Settings, store: Store, driver: QemuDriver) -> None:
        self.settings = settings
        self.store = store
        self.driver = driver
        self._vms: dict[str, QemuVM] = {}
        self._locks: dict[str, asyncio.Lock] = {}

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

    def events(self, tenant: str, sandbox_id: str, after: int = 0) -> list[dict[str, Any]]:
        row = self.store.get_sandbox(sandbox_id)
        if row is None or row["tenant"] != tenant:
            raise errors.NotFound(f"no sandbox {sandbox_id!r}")
        return self.store.events(sandbox_id, after)

    # -- lifecycle -----------------------------------------------------------------------

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
        sandbox_id = f"sb-{secrets.token_hex(8)}"
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
                "labels": req.labels,
            }
        )
        async with self._lock(sandbox_id):
            try:
                vm = await self.driver.boot(
                    req.template,
                    vcpus=req.vcpus,
                    memory_mib=req.memory_mib,
                    disk_mib=req.disk_mib,
                    name=sandbox_id,
                    boot_timeout=self.settings.boot_timeout,
                )
            except BaseException as exc:
                message = str(exc) if isinstance(exc, errors.CellaError) else repr(exc)
                self.store.update_sandbox(sandbox_id, state=S.error, error=message[:2000])
                self.store.add_event(sandbox_id, "create_failed", {"error": message[:2000]})
                raise
            self._vms[sandbox_id] = vm
            self.store.update_sandbox(
                sandbox_id,
                state=S.running,
                pid=vm.pid,
                accel=vm.accel,
                accel_reason=vm.accel_reason,
            )
            self.store.add_event(
                sandbox_id,
                "created",
                {"template": req.template, "boot_ms": round((vm.boot_seconds or 0) * 1000, 1)},
            )
        return self.get(tenant, sandbox_id)

    async def stop(self, tenant: str, sandbox_id: str) -> dict[str, Any]:
        """Ends every process; the disk (files, installed packages) stays."""
        async with self._lock(sandbox_id):
            row = self.get(tenant, sandbox_id)
            if row["state"] == S.stopped:
                return row
            if row["state"] != S.running:
                raise errors.InvalidState(f"cannot stop a sandbox that is {row['state']}")
            self.store.update_sandbox(sandbox_id, state=S.stopping)
            vm = self._vms.pop(sandbox_id, None)
            if vm is not None:
                await vm.stop()
            self.store.update_sandbox(sandbox_id, state=S.stopped, pid=None)
            self.store.add_event(sandbox_id, "stopped")
        return self.get(tenant, sandbox_id)

    async def resume(self, tenant: str, sandbox_id: str) -> dict[str, Any]:
        """Boots the same overlay again: what was written before the stop is still there."""
        async with self._lock(sandbox_id):
            row = self.get(tenant, sandbox_id)
            if row["state"] == S.running:
                return row
            if row["state"] != S.stopped:
                raise errors.InvalidState(f"cannot resume a sandbox that is {row['state']}")
            self.store.update_sandbox(sandbox_id, state=S.starting)
            try:
                vm = await self.driver.start(
                    self.directory(sandbox_id),
                    vcpus=row["vcpus"],
                    memory_mib=row["memory_mib"],
                    boot_timeout=self.settings.boot_timeout,
                )
            except BaseException:
                self.store.update_sandbox(sandbox_id, state=S.stopped, pid=None)
                raise
            self._vms[sandbox_id] = vm
            self.store.update_sandbox(sandbox_id, state=S.running, pid=vm.pid)
            self.store.add_event(sandbox_id, "resumed")
        return self.get(tenant, sandbox_id)

    async def delete(self, tenant: str, sandbox_id: str) -> None:
        async with self._lock(sandbox_id):
            self.get(tenant, sandbox_id)
            self.store.update_sandbox(sandbox_id, state=S.deleting)
            await self._teardown(sandbox_id)
            self.store.update_sandbox(sandbox_id, state=S.deleted, pid=None)
            self.store.add_event(sandbox_id, "deleted")
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
        """Daemon exit: VMs keep running and are adopted by the next daemon."""
        for vm in list(self._vms.values()):
            await vm._close_channels()
        self._vms.clear()

    # -- exec and files -----------------------------------------------------------------

    def vm(self, tenant: str, sandbox_id: str) -> QemuVM:
        row = self.get(tenant, sandbox_id)
        vm = self._vms.get(sandbox_id)
        if row["state"] != S.running or vm is None:
            raise errors.InvalidState(f"sandbox {sandbox_id} is {row['state']}, not running")
        return vm

    async def exec_stream(
        self, tenant: str, sandbox_id: str, command: list[str] | str, **kwargs: Any
    ) -> AsyncIterator[ExecEvent]:
        vm = self.vm(tenant, sandbox_id)
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
            self.store.add_event(
                sandbox_id,
                "exec",
                {
                    "command": command,
                    "cwd": kwargs.get("cwd"),
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
                self.store.add_event(sid, "recovered", {"from": state, "to": final})
                counts["cleaned"] += 1
            elif state in (S.running, S.starting, S.stopping):
                vm = None
                if pid and state != S.stopping:
                    with contextlib.suppress(errors.CellaError, OSError, TimeoutError):
                        vm = await self.driver.adopt(directory, pid)
                if vm is not None:
                    self._vms[sid] = vm
                    self.store.update_sandbox(sid, state=S.running)
                    self.store.add_event(sid, "adopted", {"pid": pid})
                    counts["adopted"] += 1
                else:
                    if pid:
                        await _kill_pid(pid, only_if_contains=str(directory / DISK))
                    for sock in ("qmp.sock", "agent.sock"):
                        (directory / sock).unlink(missing_ok=True)
                    self.store.update_sandbox(sid, state=S.stopped, pid=None)
                    self.store.add_event(sid, "recovered", {"from": state, "to": S.stopped})
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
