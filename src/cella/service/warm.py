"""Fast starts: a warm snapshot per template and shape, and a pool of VMs restored from it.

A create claims a pooled VM (already restored, agent connected) when one fits; otherwise it
restores from the warm snapshot; it never cold-boots. The pool refills in the background,
when creates have gone quiet (a refill shares the cores with the creates and their first
commands), a few restores at once. It grows with demand: after a burst of N creates at once
it keeps up to N ready (at most `max_size`), and shrinks back to `size` once no burst came
for `shrink_seconds`, or at once when admission needs the room.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from cella import errors
from cella.config import DaemonSettings
from cella.images.templates import builtin_templates
from cella.runtime.contract import VM, Driver
from cella.storage.snapshots import SnapshotDir

log = logging.getLogger("cella.warm")
WARM_UP = (
    "true; cat /dev/null; ls / >/dev/null; head -c1 /dev/urandom >/dev/null; hostname >/dev/null"
)


QUIET = 0.5  # seconds without a create before the pool restores more: a burst's first
# commands run on the cores before its refills do


@dataclass(frozen=True, slots=True)
class Shape:
    template: str
    vcpus: int
    memory_mib: int


def new_sandbox_id() -> str:
    return f"sb-{secrets.token_hex(8)}"


class WarmSnapshots:
    """Template snapshots in the shared image cache, keyed by everything they depend on."""

    def __init__(self, driver: Driver, boot_timeout: float = 60.0) -> None:
        self.driver = driver
        self.boot_timeout = boot_timeout
        self._locks: dict[Shape, asyncio.Lock] = {}
        self._where: dict[Shape, SnapshotDir] = {}

    def location(self, shape: Shape) -> SnapshotDir:
        if shape in self._where:
            return self._where[shape]
        key = self.driver.warm_key(shape.template, shape.vcpus, shape.memory_mib)
        builtin = shape.template in builtin_templates()
        root = self.driver.paths.warm_snapshots(builtin)
        where = SnapshotDir(root / f"{shape.template}-{key}")
        self._where[shape] = where
        return where

    def forget(self, template: str) -> None:
        """The template changed (rebuilt, or removed): its snapshots are found anew."""
        for shape in [s for s in self._where if s.template == template]:
            del self._where[shape]

    def forget_all(self) -> None:
        """The kernel changed: every shape's snapshot is found anew."""
        self._where.clear()

    async def ensure(self, shape: Shape) -> SnapshotDir:
        """The warm snapshot for `shape`, made now (one cold boot) if there is none yet."""
        await self.driver.prepare()
        snap = self.location(shape)
        async with self._locks.setdefault(shape, asyncio.Lock()):
            if snap.exists():
                try:
                    snap.verify()
                    return snap
                except errors.SnapshotCorrupt as exc:
                    # a template snapshot is derived data: rebuild rather than refuse. The
                    # old one is moved aside, not deleted: running VMs' disks sit on it.
                    log.error("warm snapshot is corrupt, making a new one: %s", exc)
                    aside = snap.path.with_name(f".{snap.path.name}.corrupt-{time.time_ns()}")
                    with contextlib.suppress(FileNotFoundError):
                        snap.path.rename(aside)
            snap.path.parent.mkdir(parents=True, exist_ok=True)
            log.info("making the warm snapshot for %s", shape)
            for attempt in (1, 2):  # one cold boot may fail on a loaded host; try once more
                try:
                    await self.driver.snapshot_template(
                        shape.template,
                        snap,
                        vcpus=shape.vcpus,
                        memory_mib=shape.memory_mib,
                        boot_timeout=self.boot_timeout,
                    )
                    break
                except errors.CellaError:
                    if attempt == 2:
                        raise
                    log.exception("warm snapshot boot failed; trying again")
            return snap


@dataclass
class _Pool:
    shape: Shape
    ready: list[VM] = field(default_factory=list)
    spares: list[tuple[SnapshotDir, VM]] = field(default_factory=list)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    target: int = 0  # VMs to keep ready: `size`, more after a burst
    grown_at: float = 0.0  # when demand last raised the target


class WarmPool:
    """Restored VMs waiting to be claimed, one pool per shape; and spares: QEMUs started
    for the shape's warm snapshot that wait for its state (`Driver.prespawn`), so a create
    that finds the pool empty only loads the state. Spares hold no guest memory of their
    own (the snapshot's RAM is mapped, not read) and are not counted as committed.

    A pooled VM belongs to no sandbox: it has no egress until a create claims it.
    """

    def __init__(
        self,
        driver: Driver,
        snapshots: WarmSnapshots,
        size: int,
        spares: int = 0,
        *,
        max_size: int | None = None,
        shrink_seconds: float = 120.0,
        refill_concurrency: int = 2,
    ) -> None:
        self.driver = driver
        self.snapshots = snapshots
        self.size = size
        # a pool of no VMs (the operator's choice) stays so
        self.max_size = size if max_size is None or size <= 0 else max(size, max_size)
        self.shrink_seconds = shrink_seconds
        self.refill_concurrency = max(1, refill_concurrency)
        self.spare_count = spares
        self._pools: dict[Shape, _Pool] = {}
        self._creating = 0  # creates under way, of any shape: they share the cores
        self._last_create = 0.0
        self._demand: dict[Shape, int] = {}
        self._peak: dict[Shape, int] = {}  # of a shape with no pool yet
        # what the pool did, for /metrics: VMs restored into it and the seconds those took
        # (the work that shares the cores with creates), creates it served and missed
        self.work = {"refills": 0.0, "refill_seconds": 0.0, "claimed": 0.0, "missed": 0.0}
        self._reaping: set[asyncio.Task[None]] = set()

    @classmethod
    def of(cls, driver: Driver, snapshots: WarmSnapshots, settings: DaemonSettings) -> WarmPool:
        """The pool as the daemon's settings size it."""
        return cls(
            driver,
            snapshots,
            settings.pool_size,
            settings.pool_spares,
            max_size=settings.pool_max_size,
            shrink_seconds=settings.pool_shrink_seconds,
        )

    def watch(self, shape: Shape) -> None:
        """Keeps a pool of `size` VMs of this shape, and its spares (filled in the
        background)."""
        if (self.size <= 0 and self.spare_count <= 0) or shape in self._pools:
            return
        # a burst before the pool existed sizes it too
        target = min(self.max_size, max(self.size, self._peak.pop(shape, 0)))
        pool = self._pools[shape] = _Pool(shape, target=target, grown_at=time.monotonic())
        pool.task = asyncio.create_task(self._refill(pool), name=f"pool-{shape.template}")

    @contextlib.contextmanager
    def creating(self, shape: Shape) -> Iterator[None]:
        """Marks a create under way: refills wait until creates go quiet, and a burst's
        size (creates of a shape at once) becomes the pool's target."""
        self._creating += 1
        self._demand[shape] = self._demand.get(shape, 0) + 1
        pool = self._pools.get(shape)
        if pool is None:
            self._peak[shape] = max(self._peak.get(shape, 0), self._demand[shape])
        elif self._demand[shape] > pool.target:
            pool.target = min(self.max_size, self._demand[shape])
            pool.grown_at = time.monotonic()
        try:
            yield
        finally:
            self._creating -= 1
            self._demand[shape] -= 1
            self._last_create = time.monotonic()

    def give_back(self) -> bool:
        """Destroys ready VMs beyond each pool's `size` (admission needs their room);
        whether there were any."""
        dropped = False
        for pool in self._pools.values():
            pool.target = self.size
            while len(pool.ready) > self.size:
                self._reap(pool.ready.pop())
                dropped = True
        return dropped

    def ready(self, shape: Shape) -> int:
        pool = self._pools.get(shape)
        return len(pool.ready) if pool else 0

    def claim(self, shape: Shape) -> VM | None:
        """A pooled VM, if one is ready. The pool refills once the claimant calls
        `refill()`: a restore started at once would share the cores with the claimed VM's
        first round trips (the create's latency), on a small host most of them."""
        pool = self._pools.get(shape)
        while pool is not None and pool.ready:
            vm = pool.ready.pop(0)
            if vm.usable:
                self.work["claimed"] += 1
                return vm
            self._reap(vm)
            pool.wake.set()  # no claimant to make room for: replace it now
        if pool is not None:
            self.work["missed"] += 1
        return None

    def _reap(self, vm: VM) -> None:
        """Destroys a pooled VM that died, in the background (`close` waits for it)."""
        task = asyncio.create_task(self.driver.destroy(vm), name=f"reap-{vm.name}")
        self._reaping.add(task)
        task.add_done_callback(self._reaping.discard)

    def claim_spare(self, shape: Shape) -> tuple[SnapshotDir, VM] | None:
        """A spare QEMU (and the snapshot it waits for), if one is up; refilled after the
        claimant's `refill()`."""
        pool = self._pools.get(shape)
        while pool is not None and pool.spares:
            snap, vm = pool.spares.pop(0)
            if vm.usable:
                return snap, vm
            self._reap(vm)
            pool.wake.set()  # no claimant to make room for: replace it now
        return None

    def refill(self, shape: Shape) -> None:
        if pool := self._pools.get(shape):
            pool.wake.set()

    async def fill(self, shape: Shape, timeout: float = 120.0) -> None:
        """Waits until the pool for `shape` is full (for tests and benchmarks)."""
        self.watch(shape)
        async with asyncio.timeout(timeout):
            while self.ready(shape) < self.size:
                await asyncio.sleep(0.02)

    def _shrink(self, pool: _Pool) -> None:
        """Back to `size` once no burst came for `shrink_seconds`."""
        if pool.target > self.size and time.monotonic() - pool.grown_at > self.shrink_seconds:
            pool.target = self.size
        while len(pool.ready) > pool.target:
            self._reap(pool.ready.pop())

    async def quiet(self) -> None:
        """Until no create has been under way for `QUIET` seconds."""
        while self._creating or time.monotonic() - self._last_create < QUIET:
            await asyncio.sleep(QUIET if self._creating else QUIET / 5)

    async def _refill(self, pool: _Pool) -> None:
        failures = 0
        while True:
            self._shrink(pool)
            if len(pool.ready) >= pool.target and len(pool.spares) >= self.spare_count:
                pool.wake.clear()
                wait = self.shrink_seconds / 2 if pool.target > self.size else None
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(pool.wake.wait(), wait)
                continue
            await self.quiet()
            try:
                snap = await self.snapshots.ensure(pool.shape)
                if len(pool.spares) < self.spare_count:  # cheap, and what an empty pool uses
                    directory = self.driver.paths.vms / new_sandbox_id()
                    pool.spares.append((snap, await self.driver.prespawn(snap, directory)))
                    failures = 0
                    continue
                n = min(self.refill_concurrency, pool.target - len(pool.ready))
                made = await asyncio.gather(
                    *(self._warm_vm(snap) for _ in range(n)), return_exceptions=True
                )
                pool.ready.extend(vm for vm in made if not isinstance(vm, BaseException))
                for exc in made:
                    if isinstance(exc, BaseException):
                        raise exc
                failures = 0
            except asyncio.CancelledError:
                raise
            except Exception:
                failures += 1
                log.exception("warm pool refill failed")
                await asyncio.sleep(min(30.0, 0.5 * 2**failures))

    async def _warm_vm(self, snap: SnapshotDir) -> VM:
        """A VM restored for the pool, its translation cache warmed."""
        started = time.perf_counter()
        vm = await self.driver.restore(snap, self.driver.paths.vms / new_sandbox_id())
        try:
            # run the usual first commands once, so this VM's translation cache is warm
            # before anyone claims it (a first exec is otherwise much slower); an image
            # without a shell simply skips it
            with contextlib.suppress(errors.NotFound, errors.GuestError):
                await vm.agent.exec(WARM_UP, timeout=60)
            seed = os.urandom(64)
            await vm.agent.set_identity(hostname="pool", time_ns=time.time_ns(), seed=seed)
        except BaseException:
            await self.driver.destroy(vm)
            raise
        self.work["refills"] += 1
        self.work["refill_seconds"] += time.perf_counter() - started
        return vm

    async def forget(self, template: str) -> None:
        """Drops the pools of a template that changed; its pooled VMs are destroyed."""
        shapes = [s for s in self._pools if s.template == template]
        await self._drop(shapes)
        self.snapshots.forget(template)

    async def close(self) -> None:
        await self._drop(list(self._pools))
        await asyncio.gather(*list(self._reaping), return_exceptions=True)

    async def _drop(self, shapes: list[Shape]) -> None:
        for pool in [self._pools.pop(s) for s in shapes]:
            if pool.task is not None:
                pool.task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await pool.task
            for vm in [*pool.ready, *(vm for _, vm in pool.spares)]:
                await self.driver.destroy(vm)
            pool.ready.clear()
            pool.spares.clear()

    def committed(self, lent: bool = True) -> tuple[int, int]:
        """(vCPUs, MiB) held by pooled VMs, counted against the host's capacity; without
        `lent`, only up to each pool's `size` (those beyond it are given back on demand)."""
        vms = [
            (p.shape, len(p.ready) if lent else min(len(p.ready), self.size))
            for p in self._pools.values()
        ]
        return (sum(s.vcpus * n for s, n in vms), sum(s.memory_mib * n for s, n in vms))

    def status(self) -> dict[str, int]:
        """Ready VMs per shape (`template/vcpus/memory_mib`)."""
        return {_label(s): len(p.ready) for s, p in self._pools.items()}

    def targets(self) -> dict[str, int]:
        """VMs each shape's pool is filling to: `size`, or more after a burst."""
        return {_label(s): p.target for s, p in self._pools.items()}

    def spares(self) -> dict[str, int]:
        """Spare QEMUs per shape."""
        return {_label(s): len(p.spares) for s, p in self._pools.items()}

    def directories(self) -> set[Path]:
        vms = [vm for p in self._pools.values() for vm in [*p.ready, *(v for _, v in p.spares)]]
        return {vm.directory for vm in vms if vm.directory}


def _label(shape: Shape) -> str:
    return f"{shape.template}/{shape.vcpus}/{shape.memory_mib}"
