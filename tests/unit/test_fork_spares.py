"""Spare QEMUs for the next fork of a snapshot (`cella.service.fork_spares`), on the fake
runtime: how many are kept, which fork uses them, when they go."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from cella.config import DaemonSettings
from cella.models import SandboxCreate
from cella.policy.access import Principal
from cella.service.daemon import Daemon
from cella.store import Store
from tests.unit.fake_runtime import FakeDriver

T = Principal.service("t")


def daemon(tmp_path: Path, **settings: object) -> tuple[Daemon, FakeDriver]:
    config = DaemonSettings(
        data_dir=tmp_path,
        image_dir=tmp_path / "images",
        pool_size=0,
        pool_spares=0,
        max_host_memory_mib=16384,
        max_host_vcpus=32,
        max_sandboxes_per_tenant=32,
        **settings,  # type: ignore[arg-type]
    )
    driver = FakeDriver(tmp_path)
    return Daemon(config, Store(tmp_path / "cella.db"), driver), driver


async def until(pred: Callable[[], bool], timeout: float = 10) -> None:
    async with asyncio.timeout(timeout):
        while not pred():
            await asyncio.sleep(0.01)


async def close(d: Daemon) -> None:
    await d.forks.spares.close()
    await d.registry.detach_all()
    d.store.close()


async def test_the_next_fork_uses_spares_up_to_the_limit(tmp_path: Path) -> None:
    d, driver = daemon(tmp_path, fork_spares=2)
    try:
        row = await d.lifecycle.create(T, SandboxCreate())
        snap = await d.snapshots.snapshot(T, row.id, "s")
        await d.forks.fork_snapshot(T, snap.id, 3)
        assert driver.spares_used == 0  # none was started before the first fork
        # a fork of three asks for three, the limit keeps two
        await until(lambda: d.forks.spares.held() == {snap.id: 2})
        await asyncio.sleep(0.7)  # past the quiet time: no third is started
        assert d.forks.spares.held() == {snap.id: 2}
        spares = {vm.directory.name for vm in driver.vms if vm.spare_of is not None}
        branches = await d.forks.fork_snapshot(T, snap.id, 3)
        assert driver.spares_used == 2  # two of three branches loaded into spares
        assert spares <= {b.id for b in branches}  # under the spares' names
        events = [d.store.events(b.id, 0, 10, ["forked"])[0].data for b in branches]
        assert sorted(e["spare"] for e in events) == [False, True, True]
        await until(lambda: d.forks.spares.held() == {snap.id: 2})  # made again
    finally:
        await close(d)


async def test_spares_go_with_their_snapshot_or_when_it_is_not_forked(tmp_path: Path) -> None:
    d, driver = daemon(tmp_path, fork_spares=4, pool_shrink_seconds=1.5)
    try:
        row = await d.lifecycle.create(T, SandboxCreate())
        kept = await d.snapshots.snapshot(T, row.id, "kept")
        gone = await d.snapshots.snapshot(T, row.id, "gone")
        for snap in (kept, gone):
            for b in await d.forks.fork_snapshot(T, snap.id, 2):
                await d.lifecycle.delete(T, b.id)
        await until(lambda: d.forks.spares.held() == {kept.id: 2, gone.id: 2})

        def spares_running() -> int:
            return sum(1 for vm in driver.vms if vm.spare_of is not None and vm.running)

        assert spares_running() == 4
        await d.snapshots.delete("t", gone.id)  # its spares end with it
        assert d.forks.spares.held() == {kept.id: 2} and spares_running() == 2
        # not forked for pool_shrink_seconds: the other's go too
        await until(lambda: d.forks.spares.held() == {} and spares_running() == 0, timeout=5)
    finally:
        await close(d)


async def test_at_the_limit_the_snapshot_forked_last_gets_them(tmp_path: Path) -> None:
    d, driver = daemon(tmp_path, fork_spares=2)
    try:
        row = await d.lifecycle.create(T, SandboxCreate())
        older = await d.snapshots.snapshot(T, row.id, "older")
        newer = await d.snapshots.snapshot(T, row.id, "newer")
        await d.forks.fork_snapshot(T, older.id, 2)
        await until(lambda: d.forks.spares.held() == {older.id: 2})
        await d.forks.fork_snapshot(T, newer.id, 2)
        await until(lambda: d.forks.spares.held() == {newer.id: 2})
        await until(lambda: sum(1 for vm in driver.vms if vm.spare_of and vm.running) == 2)
    finally:
        await close(d)


async def test_no_spares_when_the_limit_is_zero(tmp_path: Path) -> None:
    d, driver = daemon(tmp_path, fork_spares=0)
    try:
        row = await d.lifecycle.create(T, SandboxCreate())
        snap = await d.snapshots.snapshot(T, row.id, "s")
        await d.forks.fork_snapshot(T, snap.id, 2)
        await asyncio.sleep(0.7)
        assert d.forks.spares.held() == {} and driver.spares_used == 0
        assert not [vm for vm in driver.vms if vm.spare_of is not None]
    finally:
        await close(d)
