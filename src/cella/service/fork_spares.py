"""Spare QEMUs for the next fork of a snapshot.

An RL or eval harness forks one prepared snapshot batch after batch. After a fork of N
branches, up to N QEMUs are started ahead for that snapshot (at most `limit` in all), each
with the snapshot's RAM mapped and its channels connected, waiting for the device state
(`Driver.prespawn`, as the warm pool's spares do for templates): a branch that gets one only
loads the state, and QEMU's own start (about half a restore's CPU under emulation, all of
it under KVM) is paid while the host is quiet. Spares are started only once creates and
forks have gone quiet; they go when their snapshot is deleted, when it was not forked for
`idle_seconds`, or at the limit, to a snapshot forked more recently. Like the pool's spares
they hold no guest memory of their own and are not counted as committed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field

from cella import errors
from cella.runtime.contract import VM, Driver
from cella.service.warm import new_sandbox_id
from cella.storage.snapshots import SnapshotDir

log = logging.getLogger("cella.fork_spares")
QUIET = 0.5  # seconds without a fork before spares are started


@dataclass
class _Wanted:
    snapshot_id: str
    snap: SnapshotDir
    count: int  # the last fork's size
    forked_at: float
    spares: list[VM] = field(default_factory=list)


class ForkSpares:
    def __init__(
        self,
        driver: Driver,
        limit: int,
        idle_seconds: float,
        quiet: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.driver = driver
        self.limit = limit
        self.idle_seconds = idle_seconds
        self._creates_quiet = quiet  # the warm pool's: creates have gone quiet
        self._wanted: dict[str, _Wanted] = {}
        self._forking = 0
        self._last_fork = 0.0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._destroying: set[asyncio.Task[None]] = set()

    @contextlib.contextmanager
    def forking(self) -> Iterator[None]:
        """Marks a fork under way: spares are not started while one is."""
        self._forking += 1
        try:
            yield
        finally:
            self._forking -= 1
            self._last_fork = time.monotonic()

    def claim(self, snapshot_id: str, count: int) -> dict[str, VM]:
        """Up to `count` spares of the snapshot, by the name of their directory: the id of
        the branch that loads each."""
        wanted = self._wanted.get(snapshot_id)
        claimed: dict[str, VM] = {}
        while wanted is not None and wanted.spares and len(claimed) < count:
            vm = wanted.spares.pop()
            if vm.usable and vm.directory is not None:
                claimed[vm.directory.name] = vm
            else:
                self._destroy_later(vm)
        return claimed

    def forked(self, snapshot_id: str, snap: SnapshotDir, count: int) -> None:
        """A fork of `count` branches was made: keep that many ready for the next one."""
        if self.limit <= 0:
            return
        wanted = self._wanted.setdefault(
            snapshot_id, _Wanted(snapshot_id, snap, count, time.monotonic())
        )
        wanted.count, wanted.forked_at = min(count, self.limit), time.monotonic()
        self._wake.set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._fill(), name="fork-spares")

    def held(self) -> dict[str, int]:
        """Spares per snapshot id."""
        return {sid: len(w.spares) for sid, w in self._wanted.items() if w.spares}

    async def drop(self, snapshot_id: str) -> None:
        """The snapshot goes: its spares are destroyed."""
        wanted = self._wanted.pop(snapshot_id, None)
        for vm in wanted.spares if wanted else []:
            await self.driver.destroy(vm)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        for snapshot_id in list(self._wanted):
            await self.drop(snapshot_id)
        await asyncio.gather(*list(self._destroying), return_exceptions=True)

    def _destroy_later(self, vm: VM) -> None:
        task = asyncio.create_task(self.driver.destroy(vm), name=f"drop-{vm.name}")
        self._destroying.add(task)
        task.add_done_callback(self._destroying.discard)

    async def _quiet(self) -> None:
        while self._forking or time.monotonic() - self._last_fork < QUIET:
            await asyncio.sleep(QUIET / 5)
        if self._creates_quiet is not None:
            await self._creates_quiet()

    def _next(self) -> _Wanted | None:
        """The snapshot forked last that lacks spares. Snapshots not forked for
        `idle_seconds` lose theirs first; at the limit, the one forked least recently
        gives one up to it."""
        now = time.monotonic()
        for snapshot_id, wanted in list(self._wanted.items()):
            if now - wanted.forked_at > self.idle_seconds:
                del self._wanted[snapshot_id]
                for vm in wanted.spares:
                    self._destroy_later(vm)
        lacking = [w for w in self._wanted.values() if len(w.spares) < w.count]
        if not lacking:
            return None
        newest = max(lacking, key=lambda w: w.forked_at)
        if sum(len(w.spares) for w in self._wanted.values()) >= self.limit:
            older = [w for w in self._wanted.values() if w.spares and w is not newest]
            older = [w for w in older if w.forked_at < newest.forked_at]
            if not older:
                return None
            self._destroy_later(min(older, key=lambda w: w.forked_at).spares.pop())
        return newest

    async def _fill(self) -> None:
        while self._wanted:
            wanted = self._next()
            if wanted is None:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):  # wake to expire idle ones
                    await asyncio.wait_for(self._wake.wait(), self.idle_seconds / 2)
                continue
            await self._quiet()
            if self._wanted.get(wanted.snapshot_id) is not wanted:
                continue  # dropped while we waited
            directory = self.driver.paths.vms / new_sandbox_id()
            try:
                vm = await self.driver.prespawn(wanted.snap, directory)
            except asyncio.CancelledError:
                raise
            except errors.InvalidArgument:  # a layered snapshot: no spares for it
                self._wanted.pop(wanted.snapshot_id, None)
                continue
            except Exception:
                log.exception("a fork spare failed to start")
                self._wanted.pop(wanted.snapshot_id, None)
                continue
            if self._wanted.get(wanted.snapshot_id) is wanted:
                wanted.spares.append(vm)
            else:
                await self.driver.destroy(vm)
