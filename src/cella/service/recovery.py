"""Recovery: after a daemon restart (or crash), every sandbox brought to a true state.

A transitional state in the store says what was interrupted. Half-made or half-removed
sandboxes are freed; VMs that outlived the daemon are adopted; those that cannot be are
stopped with their disk kept; QEMU processes and directories nobody owns are removed, and
snapshots interrupted while being made are marked failed. No disk a sandbox or snapshot
still owns is ever deleted. `plan()` decides per row; `Recovery` acts.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from typing import Literal

from cella import errors
from cella.models import SandboxState
from cella.service.egress import SandboxEgress
from cella.service.lifecycle import Lifecycle
from cella.service.registry import Registry
from cella.store import SandboxRecord

log = logging.getLogger("cella.recovery")
S = SandboxState
Plan = Literal["free", "adopt", "stop", "keep"]


def plan(row: SandboxRecord) -> Plan:
    """What to do with a row found at start: `free` its VM and files (it was being made or
    removed), try to `adopt` its VM (it was running or paused), `stop` it (its VM was being
    stopped or is unknown), or `keep` it as it is."""
    if row.state in (S.creating, S.deleting):
        return "free"
    if row.state in (S.running, S.paused, S.starting) and row.pid:
        return "adopt"
    if row.state in (S.running, S.paused, S.starting, S.stopping):
        return "stop"
    return "keep"


class Recovery:
    def __init__(self, registry: Registry, lifecycle: Lifecycle, egress: SandboxEgress) -> None:
        self.registry = registry
        self.lifecycle = lifecycle
        self.egress = egress
        self.driver = registry.driver
        self.events = registry.events

    async def recover(self) -> dict[str, int]:
        counts = {"adopted": 0, "stopped": 0, "cleaned": 0, "strays_killed": 0}
        for row in self.registry.find(None):
            action = plan(row)
            if action == "free":
                await self._free(row)
                counts["cleaned"] += 1
            elif action == "adopt" and await self._adopt(row):
                counts["adopted"] += 1
            elif action in ("adopt", "stop"):
                await self._stop(row)
                counts["stopped"] += 1
        counts["strays_killed"] = await self._sweep()
        log.info("recovery: %s", counts)
        return counts

    async def _free(self, row: SandboxRecord) -> None:
        """Half-made or half-removed: nothing the user can rely on."""
        await self.lifecycle.teardown(row.id)
        final = S.deleted if row.state == S.deleting else S.error
        error = None if final == S.deleted else "interrupted while being created"
        self.registry.update(row.id, state=final, pid=None, error=error)
        self.events.emit(row.id, "recovered", {"from": row.state, "to": final})

    async def _adopt(self, row: SandboxRecord) -> bool:
        assert row.pid is not None
        paused = row.state == S.paused
        try:
            vm = await self.driver.adopt(self.registry.directory(row.id), row.pid, paused=paused)
        except (errors.CellaError, OSError, TimeoutError):
            return False
        self.registry.track(row.id, vm)
        self.egress.attach(vm, row)
        self.lifecycle.exec_policies.attach(vm, row)  # its guest kept its policy in memory
        self.registry.update(row.id, state=S.paused if paused else S.running)
        self.events.emit(row.id, "adopted", {"pid": row.pid})
        return True

    async def _stop(self, row: SandboxRecord) -> None:
        directory = self.registry.directory(row.id)
        if row.pid:
            await self.driver.kill_pid(row.pid, directory)
        self.driver.clear_sockets(directory)
        self.registry.update(row.id, state=S.stopped, pid=None)
        self.events.emit(row.id, "recovered", {"from": row.state, "to": S.stopped})

    async def _sweep(self) -> int:
        """QEMU processes, VM directories and snapshot scratch that nothing owns."""
        strays = self.driver.stray_pids(self.registry.live_pids())
        for pid in strays:
            await self.driver.kill_pid(pid)
        store = self.registry.store
        owners = {r.id for r in store.list_sandboxes(None) if r.state not in (S.deleted, S.error)}
        vms = self.driver.paths.vms
        if vms.exists():
            for entry in vms.iterdir():
                if entry.name not in owners:
                    self.driver.remove_directory(entry)
        snapshots = self.driver.paths.root / "snapshots"
        for snap in store.list_snapshots(None, ["creating"]):
            if not any(store.snapshot_users(snap.id)):
                shutil.rmtree(snapshots / snap.id, ignore_errors=True)
            store.update_snapshot(snap.id, state="error", error="daemon restarted")
        if snapshots.exists():
            for entry in snapshots.iterdir():
                if entry.name.startswith("."):
                    with contextlib.suppress(OSError):
                        shutil.rmtree(entry)
        return len(strays)
