"""Admission: whether a sandbox may start at all.

Owns the host's per-sandbox maxima (a request's own ranges are checked by its model), the
tenant quotas (live sandboxes; host disk, stopped sandboxes and snapshots included) and the
host's RAM/vCPU commitment, with pooled VMs counted. Every way into running is admitted:
create, fork, and resume of a stopped sandbox. `admit()` holds one lock from the check until
the caller has written its state, so concurrent requests cannot both slip under a limit.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from cella import errors
from cella.config import DaemonSettings
from cella.models import Capacity, SandboxState
from cella.service.registry import Registry


class Admission:
    def __init__(
        self, settings: DaemonSettings, registry: Registry, pooled: Callable[[], tuple[int, int]]
    ) -> None:
        self.settings = settings
        self.registry = registry
        self.pooled = pooled  # (vCPUs, MiB) held by the warm pool
        self._lock = asyncio.Lock()

    def check_shape(self, vcpus: int, memory_mib: int, disk_mib: int | None) -> None:
        """Against this host's maxima for one sandbox."""
        s = self.settings
        if vcpus > s.max_vcpus:
            raise errors.InvalidArgument(f"vcpus must be at most {s.max_vcpus} on this host")
        if memory_mib > s.max_memory_mib:
            raise errors.InvalidArgument(
                f"memory_mib must be at most {s.max_memory_mib} on this host"
            )
        if disk_mib is not None and disk_mib > s.max_disk_mib:
            raise errors.InvalidArgument(f"disk_mib must be at most {s.max_disk_mib}")

    @contextlib.asynccontextmanager
    async def admit(
        self, tenant: str, vcpus: int, memory_mib: int, count: int = 1
    ) -> AsyncIterator[None]:
        """Refuses what would exceed the tenant's quota or over-commit the host; the
        block runs under the admission lock (write the rows there)."""
        async with self._lock:
            self._check(tenant, vcpus, memory_mib, count)
            yield

    def capacity(self) -> Capacity:
        """The host's commitment limits and what is committed (live sandboxes, the pool)."""
        live = self.registry.live_rows()
        pooled_cpus, pooled_memory = self.pooled()
        return Capacity(
            memory_mib=self.settings.max_host_memory_mib,
            memory_mib_committed=sum(r.memory_mib for r in live) + pooled_memory,
            vcpus=self.settings.max_host_vcpus,
            vcpus_committed=sum(r.vcpus for r in live) + pooled_cpus,
            live_sandboxes=len(live),
        )

    def disk_mib(self, tenant: str) -> int:
        """Host disk the tenant's sandboxes (running or stopped) and snapshots take."""
        store = self.registry.store
        total = sum(
            self.registry.disk_bytes(r.id)
            for r in store.list_sandboxes(tenant)
            if r.state not in (SandboxState.deleted, SandboxState.error)
        )
        total += sum(s.size_bytes or 0 for s in store.list_snapshots(tenant, ["ready"]))
        return total >> 20

    def _check(self, tenant: str, vcpus: int, memory_mib: int, count: int) -> None:
        s = self.settings
        live = self.registry.live_rows()
        mine = sum(1 for r in live if r.tenant == tenant)
        if mine + count > s.max_sandboxes_per_tenant:
            raise errors.QuotaExceeded(
                f"tenant {tenant!r} has {mine} live sandboxes; the limit is "
                f"{s.max_sandboxes_per_tenant}"
            )
        if s.max_disk_mib_per_tenant is not None:
            used = self.disk_mib(tenant)
            if used >= s.max_disk_mib_per_tenant:
                raise errors.QuotaExceeded(
                    f"tenant {tenant!r} holds {used} MiB of disk (sandboxes, stopped ones "
                    f"included, and snapshots); the limit is {s.max_disk_mib_per_tenant} MiB"
                )
        pooled_cpus, pooled_memory = self.pooled()
        memory = sum(r.memory_mib for r in live) + pooled_memory + count * memory_mib
        cpus = sum(r.vcpus for r in live) + pooled_cpus + count * vcpus
        if memory > s.max_host_memory_mib:
            raise errors.CapacityExceeded(
                f"{count * memory_mib} MiB more would commit {memory} of the host's "
                f"{s.max_host_memory_mib} MiB"
            )
        if cpus > s.max_host_vcpus:
            raise errors.CapacityExceeded(
                f"{count * vcpus} more vCPUs would commit {cpus} of the host's {s.max_host_vcpus}"
            )
