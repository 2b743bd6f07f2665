"""Forks: new sandboxes restored from a snapshot, each on its own overlay, sharing the
snapshot's unchanged disk and memory. A snapshot without memory (or a create that asks for
none of it, `restore_memory="never"`) boots from the snapshot's disk instead.

Owns fork admission (the branches are admitted together, as one request), booting a
sandbox from a snapshot (`snapshot` in a create), and undoing the branches already made
when one of them fails. A fork of several branches waits for the snapshot's flat RAM file,
which their VMs share.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from cella import errors
from cella.models import SandboxCreate, SnapshotState
from cella.models.sandbox import RestoreMemory
from cella.policy.access import Principal
from cella.runtime.contract import VM
from cella.service.admission import Admission
from cella.service.egress import rules_of
from cella.service.fork_spares import ForkSpares
from cella.service.lifecycle import Lifecycle, restore_spans_ms
from cella.service.registry import Registry
from cella.service.rewrites import kept_setter
from cella.service.sandbox_rows import new_record
from cella.service.snapshots import Snapshots
from cella.service.warm import new_sandbox_id
from cella.storage.snapshots import SnapshotDir
from cella.store import SandboxRecord, SnapshotRecord


class Forks:
    def __init__(
        self,
        registry: Registry,
        admission: Admission,
        lifecycle: Lifecycle,
        snapshots: Snapshots,
    ) -> None:
        self.registry = registry
        self.driver = registry.driver
        self.events = registry.events
        self.admission = admission
        self.lifecycle = lifecycle
        self.snapshots = snapshots
        settings = lifecycle.settings
        self.spares = ForkSpares(
            self.driver, settings.fork_spares, settings.pool_shrink_seconds, lifecycle.pool.quiet
        )
        snapshots.deleted_hooks.append(self.spares.drop)

    async def fork(self, who: Principal, sandbox_id: str, count: int) -> list[SandboxRecord]:
        """Snapshots a running sandbox once (a caller who may exec in it), then restores
        `count` branches from it: each is the forking key's, as a sandbox it made."""
        snap = await self.snapshots.snapshot(who, sandbox_id, f"fork of {sandbox_id}")
        return await self.fork_snapshot(who, snap.id, count)

    async def boot(
        self, who: Principal, spec: SandboxCreate, delegation: dict[str, Any] | None = None
    ) -> SandboxRecord:
        """A new sandbox from `spec.snapshot` (its files, memory and processes), made as
        `spec` says otherwise (name, limits, egress, secrets); its shape is the snapshot's."""
        assert spec.snapshot is not None
        snap = self.snapshots.resolve(who.tenant, spec.snapshot)
        self.admission.check_shape(snap.vcpus, snap.memory_mib, spec.disk_mib)
        [row] = await self.fork_snapshot(
            who, snap.id, 1, spec, spec.restore_memory, delegation=delegation
        )
        return row

    async def fork_snapshot(
        self,
        who: Principal,
        snapshot_id: str,
        count: int,
        spec: SandboxCreate | None = None,
        restore_memory: RestoreMemory = "if_present",
        delegation: dict[str, Any] | None = None,
    ) -> list[SandboxRecord]:
        """`count` new sandboxes restored from the snapshot, each on its own overlay, made
        like the snapshot's source unless `spec` says otherwise. Its memory is restored
        as `restore_memory` says: when it has one, insisted on, or never (a boot from its
        disk)."""
        tenant = who.tenant
        snap_row = self.snapshots.get(tenant, snapshot_id)
        if snap_row.state != SnapshotState.ready:
            raise errors.InvalidState(f"snapshot {snapshot_id} is {snap_row.state}")
        if restore_memory == "always" and not snap_row.memory:
            raise errors.InvalidArgument(
                f"restore_memory=always: snapshot {snapshot_id} was taken without memory "
                "(boot from its disk: if_present or never)"
            )
        memory = snap_row.memory and restore_memory != "never"
        snap = self.snapshots.directory(snapshot_id)
        flat_began = time.perf_counter()
        if count > 1 and memory:  # one shared RAM file beats a copy of the layer in every branch
            with contextlib.suppress(errors.SnapshotCorrupt):
                await self.snapshots.flat(snap_row.id)  # if it cannot be, the layer restores
        flat_wait = round((time.perf_counter() - flat_began) * 1000, 1)
        snap.verify()  # refuse a corrupted snapshot before creating anything
        inherited = None
        if spec is None:  # the same placeholders: the parent's env is copied with its memory
            spec, secrets = self.snapshots.source_of(snap_row)
            parent = self.registry.store.get_sandbox(snap_row.sandbox_id)
            if parent is not None:  # its rewrite rules keep their setter
                inherited = kept_setter(parent)
        else:
            secrets = self.lifecycle.egress.bind_secrets(tenant, spec.secrets)
            settled = self.lifecycle.egress.check_policy(who, spec.network)
            spec = spec.model_copy(update={"network": settled})
            self.lifecycle.egress.check_policy(who, rules_of(spec))
        shape = {"vcpus": snap_row.vcpus, "memory_mib": snap_row.memory_mib}
        spec = spec.model_copy(update=shape)
        with self.spares.forking():
            async with self.admission.admit(tenant, snap_row.vcpus, snap_row.memory_mib, count):
                self.registry.check_name(tenant, who.principal or None, spec.name)
                # QEMUs started ahead for this snapshot: their branches take their ids
                spares = self.spares.claim(snap_row.id, count) if memory else {}
                ids = [*spares, *(new_sandbox_id() for _ in range(count - len(spares)))]
                try:
                    rows = self.registry.insert_many(  # one transaction for the branches
                        [
                            new_record(
                                who,
                                sandbox_id,
                                spec,
                                secrets,
                                "fork",
                                inherited_setter=inherited,
                                parent_id=snap_row.sandbox_id,
                                snapshot_id=snap_row.id,
                                base_snapshot_id=snap_row.id,
                                delegation=delegation,
                            )
                            for sandbox_id in ids
                        ]
                    )
                except BaseException:
                    for vm in spares.values():
                        await self.driver.destroy(vm)
                    raise

            async def one(row: SandboxRecord) -> str:
                began = time.perf_counter()
                async with self.lifecycle.restoring:  # shared with creates
                    return await self._restore_fork(
                        snap_row, snap, row, memory, began, flat_wait, spares.get(row.id)
                    )

            results = await asyncio.gather(*(one(r) for r in rows), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            for result in results:
                if isinstance(result, str):
                    await self.lifecycle.delete(who, result)
            raise failed[0]
        if memory:  # the next fork of this snapshot finds QEMUs started for it
            self.spares.forked(snap_row.id, snap, count)
        return [self.registry.get(who, r.id) for r in rows]

    async def _restore_fork(
        self,
        snap_row: SnapshotRecord,
        snap: SnapshotDir,
        row: SandboxRecord,
        memory: bool,
        began: float,
        flat_wait_ms: float = 0.0,
        spare: VM | None = None,
    ) -> str:
        async with self.registry.lock(row.id):
            gated = time.perf_counter()
            vm = None
            try:
                if memory:
                    vm = await self.lifecycle.restore_vm(snap, row.id, spare)
                else:  # its files, none of what ran
                    vm = await self.driver.boot_snapshot(
                        snap,
                        self.registry.directory(row.id),
                        vcpus=row.vcpus,
                        memory_mib=row.memory_mib,
                        boot_timeout=self.lifecycle.settings.boot_timeout,
                    )
                restored = time.perf_counter()
                await self.lifecycle.ready(vm, row)  # the parent's policy and placeholders
                if not memory:  # what its template had running, started anew
                    await self.lifecycle.start_commands.run(vm, row.id, row.template)
            except BaseException as exc:
                if vm is not None:
                    await self.driver.destroy(vm)
                self.driver.remove_directory(self.registry.directory(row.id))
                self.registry.fail(row.id, exc)
                raise
            readied = time.perf_counter()
            self.lifecycle.running(row.id, vm)
            self.events.emit(
                row.id,
                "forked",
                {
                    "parent_id": snap_row.sandbox_id,
                    "snapshot_id": snap_row.id,
                    "memory": memory,
                    "spare": spare is not None,
                    "restore_ms": round((vm.boot_seconds or 0) * 1000, 1),
                    # where its time went: the fork's wait for the snapshot's flat RAM
                    # file, the gate, the VM (by step), readying it
                    "flat_wait_ms": flat_wait_ms,
                    "restore_wait_ms": round((gated - began) * 1000, 1),
                    "vm_ms": round((restored - gated) * 1000, 1),
                    "ready_ms": round((readied - restored) * 1000, 1),
                    **restore_spans_ms(vm),
                },
            )
        return row.id
