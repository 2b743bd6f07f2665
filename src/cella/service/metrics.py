"""Metrics over time: every running sandbox's CPU, memory and disk, sampled every
`metrics_interval` seconds and kept (the newest `metrics_keep` per sandbox) in the store.

CPU comes from the host: the CPU time of the VM's QEMU process (its cgroup's where it has
one) over the wall time between two samples, shared out over the sandbox's vCPUs. The host
measures it whatever the guest does, and it is what the sandbox costs (under TCG that
includes translating the guest's code). Memory and disk come from inside the guest, since
only the guest knows which of its pages hold data or cache and how full its file system is:
`/proc/meminfo` read through the agent at every sample, the root file system's `statfs`
(an exec of `stat -f`, so at most every `DISK_SECONDS`). What the guest says is bounded by
what the sandbox was given; when it does not answer, the host's view stands in (the
QEMU's share of host memory, the disk overlay's allocated bytes). A sandbox whose lock is
held (a snapshot, stop or pause under way) is not asked that time."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

from cella import errors
from cella.config import DaemonSettings
from cella.models import SandboxState
from cella.policy.access import Principal
from cella.runtime.contract import VM
from cella.service.registry import Registry
from cella.store import MetricRecord, SandboxRecord

log = logging.getLogger("cella.metrics")
DISK_SECONDS = 30.0
MAX_IDS = 100  # sandboxes one call may ask for
AT_ONCE = 8  # sandboxes sampled together
MIB = 1 << 20


@dataclass
class _Last:
    vm: VM
    wall: float
    cpu: float
    disk_at: float = 0.0
    disk: tuple[int, int] | None = None  # (used, total) bytes, from the guest


class Metrics:
    def __init__(self, settings: DaemonSettings, registry: Registry) -> None:
        self.registry = registry
        self.store = registry.store
        self.driver = registry.driver
        self.interval = settings.metrics_interval
        self.keep = settings.metrics_keep
        self._last: dict[str, _Last] = {}
        self._task: asyncio.Task[None] | None = None
        registry.forget_hooks.append(self._forget)

    def start(self) -> None:
        if self.interval > 0 and self._task is None:
            self._task = asyncio.create_task(self._loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def _forget(self, sandbox_id: str) -> None:
        self._last.pop(sandbox_id, None)
        self.store.drop_metrics(sandbox_id)

    # -- reading ----------------------------------------------------------------------------

    def history(
        self,
        who: Principal,
        sandbox_id: str,
        start: float | None = None,
        end: float | None = None,
    ) -> list[MetricRecord]:
        """The sandbox's samples between `start` and `end` (unix seconds), oldest first."""
        if start is not None and end is not None and start > end:
            raise errors.InvalidArgument("start is after end")
        row = self.registry.get(who, sandbox_id)
        return self.store.metrics(row.id, start, end)

    def latest(self, who: Principal, sandbox_ids: list[str]) -> dict[str, MetricRecord]:
        """The newest sample of each of the sandboxes the caller may see (others are left
        out, as are those with none yet)."""
        if len(sandbox_ids) > MAX_IDS:
            raise errors.InvalidArgument(f"at most {MAX_IDS} sandboxes at once")
        seen = []
        for sandbox_id in dict.fromkeys(sandbox_ids):
            with contextlib.suppress(errors.NotFound):
                seen.append(self.registry.get(who, sandbox_id).id)
        return self.store.latest_metrics(seen)

    # -- sampling ---------------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.sample_all()
            except Exception:
                log.exception("sampling metrics failed")

    async def sample_all(self) -> None:
        """A sample of every running sandbox (`AT_ONCE` asked together)."""
        gate = asyncio.Semaphore(AT_ONCE)

        async def one(sandbox_id: str, vm: VM) -> None:
            row = self.store.get_sandbox(sandbox_id)
            if row is None or row.state != SandboxState.running or vm.pid is None:
                return
            if self.registry.lock(sandbox_id).locked():
                return  # a snapshot, stop or pause under way: no guest calls across it
            async with gate:
                try:
                    await asyncio.wait_for(self.sample(row, vm), max(self.interval, 5.0))
                except (errors.CellaError, OSError, TimeoutError, ValueError) as exc:
                    log.debug("no metrics for %s: %s", sandbox_id, exc)

        await asyncio.gather(*(one(i, vm) for i, vm in self.registry.vms().items()))

    async def sample(self, row: SandboxRecord, vm: VM) -> MetricRecord | None:
        """Takes one sample (the first of a VM only sets where its CPU time starts)."""
        wall, cpu = time.monotonic(), self.driver.cpu_seconds(vm)
        if cpu is None:
            return None
        last = self._last.get(row.id)
        if last is None or last.vm is not vm:
            self._last[row.id] = _Last(vm, wall, cpu)
            return None
        elapsed = wall - last.wall
        pct = (cpu - last.cpu) / elapsed / max(1, row.vcpus) * 100 if elapsed > 0 else 0.0
        last.wall, last.cpu = wall, cpu
        mem_total = row.memory_mib * MIB
        mem_used, mem_cache = await self._memory(vm, mem_total)
        if wall - last.disk_at >= DISK_SECONDS:
            last.disk_at = wall
            last.disk = await self._disk(vm) or last.disk
        disk_total = (row.disk_mib or self.driver.template_disk_mib(row.template)) * MIB
        if last.disk is not None:
            disk_used, disk_total = last.disk
        else:
            disk_used = min(self.registry.disk_bytes(row.id), disk_total)
        sample = MetricRecord(
            sandbox_id=row.id,
            at=time.time(),
            cpu_count=row.vcpus,
            cpu_used_pct=round(min(100.0, max(0.0, pct)), 2),
            mem_used=mem_used,
            mem_total=mem_total,
            mem_cache=mem_cache,
            disk_used=disk_used,
            disk_total=disk_total,
        )
        self.store.add_metric(sample, self.keep)
        return sample

    async def _memory(self, vm: VM, total: int) -> tuple[int, int]:
        """(used, cache) bytes as the guest counts them, bounded by what it was given."""
        try:
            text = (await vm.agent.read_file("/proc/meminfo"))[:8192].decode()
            kib = {}
            for line in text.splitlines():
                name, _, value = line.partition(":")
                if value.split() and value.split()[0].isdigit():
                    kib[name] = int(value.split()[0]) << 10
            used = kib["MemTotal"] - kib["MemAvailable"]
            cache = kib.get("Cached", 0) + kib.get("Buffers", 0)
        except (errors.CellaError, KeyError, UnicodeDecodeError):
            pss = self.driver.host_memory_mib(vm)
            used, cache = int((pss or 0) * MIB), 0
        return min(max(0, used), total), min(max(0, cache), total)

    async def _disk(self, vm: VM) -> tuple[int, int] | None:
        with contextlib.suppress(errors.CellaError, ValueError):
            out = await vm.agent.exec(["stat", "-f", "-c", "%S %b %f", "/"], timeout=10)
            if out.exit_code == 0:
                size, blocks, free = (int(x) for x in out.stdout.split()[:3])
                total = max(0, size * blocks)
                return min(max(0, size * (blocks - free)), total), total
        return None
