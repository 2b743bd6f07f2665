"""The lifecycle state machine: create, stop, pause, resume, delete.

States: creating -> running <-> paused, running -> stopping -> stopped -> starting ->
running, any -> deleting -> deleted, and error. Each state is written before it is acted
on, so recovery after a crash knows what was interrupted. This room also owns how a VM is
readied for a sandbox (egress attached, fresh identity) and how one is taken apart (its row
is built in `sandbox_rows`, shared with forks).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from typing import Any

from cella import errors
from cella.config import DaemonSettings
from cella.images import oci, templates
from cella.models import ExecDefaults, SandboxCreate, SandboxState
from cella.policy.access import Permission, Principal
from cella.runtime.contract import VM
from cella.service.admission import Admission
from cella.service.egress import SandboxEgress, rules_of
from cella.service.exec_policy import ExecPolicies
from cella.service.registry import Registry, iso
from cella.service.sandbox_rows import new_record
from cella.service.start_commands import StartCommands
from cella.service.warm import Shape, WarmPool, WarmSnapshots, new_sandbox_id
from cella.storage.snapshots import SnapshotDir
from cella.store import SandboxRecord, SecretRef

S = SandboxState
MANAGE = Permission.manage  # stop, pause, delete, change: the sandbox's creator's kind of use


def spans_ms(*at: float) -> dict[str, float]:
    """Where a create's time went in the daemon, from the instants it began, was admitted,
    got its turn to restore, had its VM (a pooled one's claim, or a restore) and had readied
    it (egress, identity, exec policy)."""
    began, admitted, gated, restored, readied = at
    return {
        "admission_ms": round((admitted - began) * 1000, 1),
        "restore_wait_ms": round((gated - admitted) * 1000, 1),
        "vm_ms": round((restored - gated) * 1000, 1),
        "ready_ms": round((readied - restored) * 1000, 1),
        "daemon_ms": round((readied - began) * 1000, 1),
    }


def restore_spans_ms(vm: VM) -> dict[str, float]:
    """The steps of a VM's restore (its overlay, QEMU's start, the state's load, the
    guest's first answer), as the driver timed them, in ms."""
    return {f"{k}_ms": round(v * 1000, 1) for k, v in vm.restore_spans.items()}


class Unset:
    """An argument left out (None means "no limit")."""


UNSET = Unset()
POOLED_SHAPE = (1, 512)  # (vCPUs, MiB) that warm pools keep ready
# restores (and their readying) at once: four per core keep the cores busy through each
# restore's waits (QMP round trips, the guest's first answers); more only queue for them
RESTORE_PARALLEL = 4 * (os.cpu_count() or 1)


class Lifecycle:
    def __init__(
        self,
        settings: DaemonSettings,
        registry: Registry,
        admission: Admission,
        egress: SandboxEgress,
        warm: WarmSnapshots,
        pool: WarmPool,
        exec_policies: ExecPolicies,
    ) -> None:
        self.settings = settings
        self.exec_policies = exec_policies
        self.registry = registry
        self.driver = registry.driver
        self.events = registry.events
        self.admission = admission
        self.egress = egress
        self.warm = warm
        self.pool = pool
        self.start_commands = StartCommands(self.driver.paths, self.events)
        # one gate for the host's creates and forks: a burst's first sandboxes answer first
        self.restoring = asyncio.Semaphore(RESTORE_PARALLEL)

    # -- create --------------------------------------------------------------------------

    async def create(
        self, who: Principal, req: SandboxCreate, delegation: dict[str, Any] | None = None
    ) -> SandboxRecord:
        """A sandbox restored from its template's warm snapshot (or a pooled VM of it);
        `delegation`: the access grant it keeps (`service.delegation`)."""
        tenant = who.tenant
        own = templates.default_shape(req.template)  # e.g. a desktop's browser wants room
        req = req.model_copy(update={k: v for k, v in own.items() if k not in req.model_fields_set})
        self.admission.check_shape(req.vcpus, req.memory_mib, req.disk_mib)
        try:
            base_mib = self.driver.template_disk_mib(req.template)
        except errors.NotFound:
            raise errors.InvalidArgument(f"unknown template {req.template!r}") from None
        if oci.owner_of(self.driver.paths, req.template) not in (None, tenant):
            # one tenant's image: to every other tenant it does not exist
            raise errors.InvalidArgument(f"unknown template {req.template!r}")
        if req.disk_mib is not None and req.disk_mib < base_mib:
            raise errors.InvalidArgument(f"disk_mib must be at least the template's {base_mib} MiB")
        shape = Shape(req.template, req.vcpus, req.memory_mib)
        secret_refs = self.egress.bind_secrets(tenant, req.secrets)
        req = req.model_copy(update={"network": self.egress.check_policy(who, req.network)})
        self.egress.check_policy(who, rules_of(req))  # and its bucket mounts' rules
        with self.pool.creating(shape):  # the pool refills after, and sizes to, bursts
            row = await self._create(who, req, shape, secret_refs, delegation)
        if (shape.vcpus, shape.memory_mib) == POOLED_SHAPE:
            self.pool.watch(shape)  # a template in use gets a pool of the default shape
        return self.registry.get(who, row.id)

    async def _create(
        self,
        who: Principal,
        req: SandboxCreate,
        shape: Shape,
        secret_refs: dict[str, SecretRef],
        delegation: dict[str, Any] | None,
    ) -> SandboxRecord:
        tenant = who.tenant
        began = time.perf_counter()  # the create's own spans, in its `created` event
        async with self.admission.admit(tenant, req.vcpus, req.memory_mib):
            admitted = time.perf_counter()
            self.registry.check_name(tenant, who.principal or None, req.name)
            vm = self.pool.claim(shape) if req.disk_mib is None else None
            spare = self.pool.claim_spare(shape) if vm is None else None
            held = vm if vm is not None else spare[1] if spare is not None else None
            sandbox_id = held.directory.name if held and held.directory else new_sandbox_id()
            origin = "pool" if vm is not None else "restore"
            row = self.registry.insert(
                new_record(who, sandbox_id, req, secret_refs, origin, delegation=delegation)
            )
        async with self.registry.lock(sandbox_id):
            try:
                async with self.restoring if vm is None else contextlib.nullcontext():
                    gated = time.perf_counter()
                    if spare is not None:  # a QEMU waiting for the warm snapshot's state
                        snap, waiting = spare
                        directory = self.registry.directory(sandbox_id)
                        vm = await self.driver.restore(snap, directory, spare=waiting)
                    elif vm is None:  # the pool is empty: restore, never cold-boot
                        vm = await self.restore_vm(await self.warm.ensure(shape), sandbox_id)
                    restored = time.perf_counter()
                    await self.ready(vm, row)
                if req.disk_mib is not None:
                    await vm.grow_disk(req.disk_mib)
            except BaseException as exc:
                if vm is not None:
                    await self.driver.destroy(vm)
                self.registry.fail(sandbox_id, exc, event="create_failed")
                raise
            finally:
                if origin == "pool" or spare is not None:
                    self.pool.refill(shape)
            self.running(sandbox_id, vm)
            self.events.emit(
                sandbox_id,
                "created",
                {
                    "template": req.template,
                    "from": origin,
                    "spare": spare is not None,
                    "restore_ms": round((vm.boot_seconds or 0) * 1000, 1),
                    **spans_ms(began, admitted, gated, restored, time.perf_counter()),
                    **(restore_spans_ms(vm) if origin == "restore" else {}),
                },
            )
        return row

    async def restore_vm(self, snap: SnapshotDir, sandbox_id: str, spare: VM | None = None) -> VM:
        """A VM restored for a sandbox (readied by `ready`); into `spare`, a QEMU started
        ahead for `snap` in the sandbox's directory, if given."""
        return await self.driver.restore(snap, self.registry.directory(sandbox_id), spare=spare)

    async def ready(self, vm: VM, row: SandboxRecord) -> None:
        """A restored guest is a copy: it gets the sandbox's egress, and its own name,
        clock, entropy and process limit."""
        if self.egress.intercepts(row) and not self._trusted_before(row):
            await self.egress.trust_ca(vm)  # only then is any of its TLS opened
        self.egress.attach(vm, row)
        # both asked at once (a fork's guest may hold its parent's exec policy): the guest
        # answers them in one wake-up, not one after the other's round trip
        await asyncio.gather(
            vm.agent.set_identity(
                hostname=row.id,
                time_ns=time.time_ns(),
                seed=os.urandom(64),
                sandbox_id=row.id,
                pids_max=row.max_pids or self.settings.default_max_pids,
            ),
            self.exec_policies.apply(vm, row, clean=row.snapshot_id is None),
        )

    def _trusted_before(self, row: SandboxRecord) -> bool:
        """A fork's guest is its parent's copy: it trusts the CA if the parent did."""
        parent = self.registry.store.get_sandbox(row.parent_id) if row.parent_id else None
        return parent is not None and self.egress.intercepts(parent)

    def running(self, sandbox_id: str, vm: VM) -> None:
        self.registry.track(sandbox_id, vm)
        self.registry.update(
            sandbox_id, state=S.running, pid=vm.pid, accel=vm.accel, accel_reason=vm.accel_reason
        )

    # -- transitions ---------------------------------------------------------------------

    async def stop(
        self, who: Principal, sandbox_id: str, *, memory: bool | None = None
    ) -> SandboxRecord:
        """Ends every process; the disk (files, installed packages) stays. A stop that
        keeps memory (`memory`, by default the sandbox's `stop_keeps_memory`; the reaper's
        idle and TTL stops too) is a pause: the processes run on after `resume`."""
        row = self.registry.get(who, sandbox_id, MANAGE)
        if (row.stop_keeps_memory if memory is None else memory) and row.state != S.stopped:
            return await self.pause(who, sandbox_id, as_stop=True)
        async with self.registry.lock(sandbox_id):
            row = self.registry.get(who, sandbox_id, MANAGE)
            if row.state == S.stopped:
                return row
            if row.state not in (S.running, S.paused):
                raise errors.InvalidState(f"cannot stop a sandbox that is {row.state}")
            self.registry.update(sandbox_id, state=S.stopping)
            vm = self.registry.untrack(sandbox_id)
            if vm is not None:
                await vm.stop()
            self.registry.update(sandbox_id, state=S.stopped, pid=None, stopped_at=iso(time.time()))
            self.admission.released()
            self.events.emit(sandbox_id, "stopped")
        return self.registry.get(who, sandbox_id)

    async def pause(
        self, who: Principal, sandbox_id: str, *, as_stop: bool = False
    ) -> SandboxRecord:
        """Freezes the VM: no CPU, memory kept; processes go on after `resume`. `as_stop`:
        a stop that keeps memory, stopped as far as retention goes
        (`delete_after_stop_seconds` counts from now) until it is resumed."""
        async with self.registry.lock(sandbox_id):
            row = self.registry.get(who, sandbox_id, MANAGE)
            if row.state == S.paused:
                return row
            _, vm = self.registry.live(who, sandbox_id, need=MANAGE)
            self.registry.update(sandbox_id, state=S.paused)
            try:
                await vm.pause()
            except BaseException:
                self.registry.update(sandbox_id, state=S.running)
                raise
            if as_stop:
                self.registry.update(sandbox_id, stopped_at=iso(time.time()))
            self.events.emit(sandbox_id, "paused")
        return self.registry.get(who, sandbox_id)

    async def awake(self, who: Principal, sandbox_id: str) -> SandboxRecord:
        """The sandbox, running: a stopped, stopping or paused one is resumed first (what
        LangSmith's calls expect; not for a read-only caller: waking commits RAM and a
        quota slot), and one still starting is waited for."""
        row = self.registry.get(who, sandbox_id)
        if row.state in (S.stopped, S.paused, S.stopping):
            if who.read_only:
                raise errors.PermissionDenied(
                    f"this key is read-only: sandbox {sandbox_id} is {row.state}, and "
                    "resuming it is a write"
                )
            return await self.resume(who, sandbox_id)
        for _ in range(600):  # a minute at most
            if row.state not in (S.creating, S.starting):
                break
            await asyncio.sleep(0.1)
            row = self.registry.get(who, sandbox_id)
        return row

    async def resume(self, who: Principal, sandbox_id: str) -> SandboxRecord:
        """Paused: the VM runs on. Stopped: boots the same overlay again (files and
        installed packages are still there; processes are not, but the template's start
        command is started again: `service.start_commands`). Whoever may exec in it
        may wake it (LangSmith's calls do, before they run)."""
        async with self.registry.lock(sandbox_id):
            row = self.registry.get(who, sandbox_id, Permission.exec)
            if row.state == S.running:
                return row
            if row.state == S.paused:
                vm = self.registry.vm(sandbox_id)
                if vm is None:
                    raise errors.InvalidState(f"sandbox {sandbox_id} lost its VM")
                await vm.resume()
                await self.exec_policies.apply(vm, row)  # it may have changed meanwhile
                self.registry.update(sandbox_id, state=S.running, stopped_at=None)
                self.events.emit(sandbox_id, "resumed", {"from": "paused"})
                return self.registry.get(who, sandbox_id)
            if row.state != S.stopped:
                raise errors.InvalidState(f"cannot resume a sandbox that is {row.state}")
            async with self.admission.admit(row.tenant, row.vcpus, row.memory_mib):
                self.registry.update(sandbox_id, state=S.starting)
            try:
                vm = await self.driver.start(
                    self.registry.directory(sandbox_id),
                    vcpus=row.vcpus,
                    memory_mib=row.memory_mib,
                    boot_timeout=self.settings.boot_timeout,
                    disk=row.disk,
                )
            except BaseException:
                self.registry.update(sandbox_id, state=S.stopped, pid=None)
                raise
            self.egress.attach(vm, row)
            await self.exec_policies.apply(vm, row, clean=True)  # a fresh boot
            self.registry.track(sandbox_id, vm)
            self.registry.update(sandbox_id, pid=vm.pid, error=None, stopped_at=None)
            await self.start_commands.run(vm, sandbox_id, row.template)  # booted from disk
            self.registry.update(sandbox_id, state=S.running)
            self.events.emit(sandbox_id, "resumed", {"from": "stopped"})
        return self.registry.get(who, sandbox_id)

    async def update(
        self,
        who: Principal,
        sandbox_id: str,
        *,
        name: str | None = None,
        ttl_seconds: int | Unset | None = UNSET,
        idle_timeout_seconds: int | Unset | None = UNSET,
        delete_after_stop_seconds: int | Unset | None = UNSET,
        exec_defaults: ExecDefaults | None = None,
    ) -> SandboxRecord:
        """Renames a sandbox or changes its lifetime (`ttl_seconds`, counted from its
        creation), retention and exec defaults (None clears a limit; leaving an argument out
        keeps it)."""
        async with self.registry.lock(sandbox_id):
            row = self.registry.get(who, sandbox_id, MANAGE)
            fields: dict[str, object] = {}
            if name is not None and name != row.name:
                self.registry.check_name(row.tenant, row.creator, name, exclude=row.id)
                fields["name"] = name
            if not isinstance(ttl_seconds, Unset):
                fields["ttl_seconds"] = ttl_seconds
            if not isinstance(idle_timeout_seconds, Unset):
                fields["idle_timeout_seconds"] = idle_timeout_seconds
            if not isinstance(delete_after_stop_seconds, Unset):
                fields["delete_after_stop_seconds"] = delete_after_stop_seconds
            if exec_defaults is not None:
                fields["exec_defaults"] = exec_defaults
            if fields:
                self.registry.update(sandbox_id, **fields)
                self.events.emit(sandbox_id, "updated", {k: str(v) for k, v in fields.items()})
        return self.registry.get(who, sandbox_id)

    async def delete(self, who: Principal, sandbox_id: str) -> None:
        async with self.registry.lock(sandbox_id):
            self.registry.get(who, sandbox_id, MANAGE)
            self.registry.update(sandbox_id, state=S.deleting)
            await self.teardown(sandbox_id)
            self.registry.update(sandbox_id, state=S.deleted, pid=None)
            self.admission.released()
            self.events.emit(sandbox_id, "deleted")
        self.registry.forget(sandbox_id)

    async def teardown(self, sandbox_id: str) -> None:
        """Kills the sandbox's VM (also one nobody tracks) and removes its files."""
        vm = self.registry.untrack(sandbox_id)
        if vm is not None:
            await vm.kill()
        directory = self.registry.directory(sandbox_id)
        for stray in self.driver.stray_pids(self.registry.live_pids(), directory):
            await self.driver.kill_pid(stray)
        self.driver.remove_directory(directory)
