"""A sandbox's limits and what it uses now: CPU time and memory on the host (from the
runtime), and memory, disk and processes inside the guest (from its agent)."""

from __future__ import annotations

import contextlib
import time
from typing import Any

from cella import errors
from cella.models import SandboxState
from cella.policy.access import Principal
from cella.service.registry import Registry

LIMITS = (
    "id",
    "state",
    "vcpus",
    "memory_mib",
    "disk_mib",
    "max_pids",
    "ttl_seconds",
    "idle_timeout_seconds",
)


class Usage:
    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.driver = registry.driver

    async def usage(self, who: Principal, sandbox_id: str) -> dict[str, Any]:
        row = self.registry.get(who, sandbox_id)
        allocated = self.registry.disk_bytes(sandbox_id)
        out: dict[str, Any] = {k: getattr(row, k) for k in LIMITS}
        out["ttl_remaining_seconds"] = (
            max(0.0, row.ttl_seconds - row.age_seconds(time.time())) if row.ttl_seconds else None
        )
        out["disk_allocated_mib"] = round(allocated / (1 << 20), 2)
        vm = self.registry.vm(sandbox_id)
        if vm is None or vm.pid is None:
            return out
        out["cpu_seconds"] = self.driver.cpu_seconds(vm)
        out["host_memory_mib"] = self.driver.host_memory_mib(vm)
        if row.state != SandboxState.running:
            return out
        meminfo = (await vm.agent.read_file("/proc/meminfo")).decode()
        fields = {ln.split(":")[0]: int(ln.split()[1]) for ln in meminfo.splitlines() if ":" in ln}
        out["guest_memory_total_mib"] = round(fields["MemTotal"] / 1024, 1)
        out["guest_memory_used_mib"] = round(
            (fields["MemTotal"] - fields["MemAvailable"]) / 1024, 1
        )
        df = None
        with contextlib.suppress(errors.CellaError):  # an image may have no `stat`
            df = await vm.agent.exec(["stat", "-f", "-c", "%S %b %f", "/"], timeout=30)
        if df is not None and df.exit_code == 0:
            size, blocks, free = (int(x) for x in df.stdout.split())
            out["guest_disk_total_mib"] = round(size * blocks / (1 << 20), 1)
            out["guest_disk_used_mib"] = round(size * (blocks - free) / (1 << 20), 1)
        with contextlib.suppress(errors.CellaError, ValueError):
            pids = await vm.agent.read_file("/sys/fs/cgroup/cella/pids.current")
            out["pids"] = int(pids)
        return out
