"""Admission: whether a sandbox may start at all.

Owns the host's per-sandbox maxima (a request's own ranges are checked by its model), the
tenant quotas (live sandboxes; host disk, stopped sandboxes and snapshots included) and the
host's RAM/vCPU commitment, with pooled VMs counted. Every way into running is admitted:
create, fork, and resume of a stopped sandbox. `admit()` holds one lock from the check until
the caller has written its state, so concurrent requests cannot both slip under a limit.
During a burst a request that does not fit yet waits, up to `admission_wait_seconds`, for
sandboxes to end (their RAM, their quota slot) before it is refused: arrivals a moment apart
are served, not bounced.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from cella import errors
from cella.config import DaemonSettings
from cella.models import Capacity, SandboxState
from cella.service.registry import Registry
from cella.service.warm import WarmPool


class Admission:
    def __init__(
        self,
        settings: DaemonSettings,
        registry: Registry,
        pool: WarmPool,
    ) -> None:
        self.settings = settings
        self.registry = registry
        self.pool = pool
        self.pooled = pool.committed  # (vCPUs, MiB) held by the warm pool
        self.give_back = pool.give_back  # the pool's VMs beyond its size, destroyed for room
        self._lock = asyncio.Lock()
        self._freed = asyncio.Event()  # set (and replaced) whenever a sandbox lets go

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
        """Refuses what would exceed the tenant's quota or over-commit the host once
        `admission_wait_seconds` passed without room; the block runs under the admission
        lock (write the rows there)."""
        wait = self.settings.admission_wait_seconds
        deadline = time.monotonic() + wait
        while True:
            freed = self._freed
            async with self._lock:
                self._check_disk(tenant)  # held disk does not come back by waiting
                try:
                    try:
                        self._check(tenant, vcpus, memory_mib, count)
                    except errors.CapacityExceeded:
                        if not self.give_back():  # a grown pool's VMs are lent room
                            raise
                        self._check(tenant, vcpus, memory_mib, count)
                except (errors.CapacityExceeded, errors.QuotaExceeded) as exc:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        if wait > 0:
                            exc.message = f"{exc.message} (after waiting {wait:g} s for room)"
                        raise
                else:
                    yield
                    return
            # room comes back when a sandbox ends (`released`) or the pool shrinks: the
            # short poll covers what does not say so
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(freed.wait(), min(left, 0.25))

    def released(self) -> None:
        """A sandbox ended or stopped: requests waiting for room check again."""
        self._freed.set()
        self._freed = asyncio.Event()

    def capacity(self) -> Capacity:
        """The host's commitment limits and what is committed (live sandboxes, the pool up
        to its size: a grown pool's other VMs give their room back to any request, so a
        fleet's planner counts it free)."""
        usage = self.registry.live_usage().values()
        pooled_cpus, pooled_memory = self.pool.committed(lent=False)
        return Capacity(
            memory_mib=self.settings.max_host_memory_mib,
            memory_mib_committed=sum(u[2] for u in usage) + pooled_memory,
            vcpus=self.settings.max_host_vcpus,
            vcpus_committed=sum(u[1] for u in usage) + pooled_cpus,
            live_sandboxes=sum(u[0] for u in usage),
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

    def _check_disk(self, tenant: str) -> None:
        limit = self.settings.max_disk_mib_per_tenant
        if limit is not None and (used := self.disk_mib(tenant)) >= limit:
            raise errors.QuotaExceeded(
                f"tenant {tenant!r} holds {used} MiB of disk (sandboxes, stopped ones "
                f"included, and snapshots); the limit is {limit} MiB"
            )

    def _check(self, tenant: str, vcpus: int, memory_mib: int, count: int) -> None:
        s = self.settings
        usage = self.registry.live_usage()
        mine = usage.get(tenant, (0, 0, 0))[0]
        if mine + count > s.max_sandboxes_per_tenant:
            raise errors.QuotaExceeded(
                f"tenant {tenant!r} has {mine} live sandboxes; the limit is "
                f"{s.max_sandboxes_per_tenant}"
            )
        pooled_cpus, pooled_memory = self.pooled()
        memory = sum(u[2] for u in usage.values()) + pooled_memory + count * memory_mib
        cpus = sum(u[1] for u in usage.values()) + pooled_cpus + count * vcpus
        if memory > s.max_host_memory_mib:
            raise errors.CapacityExceeded(
                f"{count * memory_mib} MiB more would commit {memory} of the host's "
                f"{s.max_host_memory_mib} MiB"
            )
        if cpus > s.max_host_vcpus:
            raise errors.CapacityExceeded(
                f"{count * vcpus} more vCPUs would commit {cpus} of the host's {s.max_host_vcpus}"
            )
