"""Bursts of creates against a real daemon: the warm pool grows to a burst's size and
shrinks back; admission queues a create for room and still refuses one past its deadline;
a burst of 100 leaves nothing behind; an idle kept-alive connection outlives the client's
own keep-alive, so no request is sent on one the daemon is closing."""

from __future__ import annotations

import asyncio
import sqlite3
import time

import httpx2
import pytest

from cella import AsyncClient, AsyncSandbox, errors
from cella.runtime.qemu.vm import qemu_cmdline
from tests.daemon import Daemon, DaemonFactory
from tests.vms import qemu_pids

POOLED = {"vcpus": 1, "memory_mib": 512}  # the shape the warm pool keeps
SMALL = {"vcpus": 1, "memory_mib": 128}  # the smallest: 100 of them fit the commitment


@pytest.fixture(scope="module")
def daemon_settings() -> dict[str, str]:
    return {"pool_size": "1", "pool_max_size": "3", "pool_shrink_seconds": "3"}


def health(d: Daemon) -> dict[str, object]:
    return dict(httpx2.get(f"{d.url}/v1/health").json())


def pooled(d: Daemon) -> int:
    pool = health(d)["pool"]
    assert isinstance(pool, dict)
    return int(pool.get("default/1/512", 0))


async def until(pred: object, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not pred():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.1)


def qemus_of(d: Daemon) -> int:
    return sum(1 for p in qemu_pids() if f"{d.data_dir}/vms/" in " ".join(qemu_cmdline(p)))


def rows_not_deleted(d: Daemon) -> list[str]:
    db = sqlite3.connect(f"file:{d.data_dir / 'cella.db'}?mode=ro", uri=True)
    try:
        return [r[0] for r in db.execute("SELECT id FROM sandboxes WHERE state != 'deleted'")]
    finally:
        db.close()


async def test_the_pool_grows_to_a_burst_and_shrinks_back(daemon: Daemon) -> None:
    async with AsyncClient(daemon.url, daemon.admin_key, timeout=300) as c:
        await (await c.create(**POOLED)).delete()  # the shape is watched from a first create
        await until(lambda: pooled(daemon) == 1)
        assert health(daemon)["pool_target"] == {"default/1/512": 1}
        burst = await asyncio.gather(*(c.create(**POOLED) for _ in range(3)))
        # three at once: the pool grows to three (its max), once the creates went quiet
        await until(lambda: pooled(daemon) == 3)
        assert health(daemon)["pool_target"] == {"default/1/512": 3}
        await asyncio.gather(*(sb.delete() for sb in burst))
        # no burst for pool_shrink_seconds: back to its size, the other two destroyed
        await until(lambda: pooled(daemon) == 1)
        assert health(daemon)["pool_target"] == {"default/1/512": 1}
        await until(lambda: qemus_of(daemon) == 1, timeout=30)
        assert rows_not_deleted(daemon) == []


async def test_admission_queues_for_room_and_refuses_past_its_deadline(
    module_daemon_factory: DaemonFactory,
) -> None:
    d = module_daemon_factory(
        "tight", pool_size="0", max_host_memory_mib="1100", admission_wait_seconds="3"
    )
    async with AsyncClient(d.url, d.admin_key, timeout=300) as c:
        a, b = [await c.create(**POOLED) for _ in range(2)]  # 1024 of 1100 MiB committed

        async def free_a() -> None:
            await asyncio.sleep(1)
            await a.delete()

        # a third does not fit: it waits, and is admitted when `a` ends
        third, _ = await asyncio.gather(c.create(**POOLED), free_a())
        (created,) = await third.events(types=["created"])
        assert created.data["admission_ms"] >= 500  # it waited in the daemon
        assert (await third.exec(["true"])).exit_code == 0

        # nothing ends: a fourth is refused once the deadline passed, saying why
        with pytest.raises(errors.CapacityExceeded, match=r"after waiting 3 s for room"):
            await c.create(**POOLED)
        assert sorted(s.id for s in await c.list()) == sorted([b.id, third.id])
        await asyncio.gather(b.delete(), third.delete())
        assert rows_not_deleted(d) == []
        assert qemus_of(d) == 0


async def test_a_burst_of_100_answers_and_leaves_nothing_behind(daemon: Daemon) -> None:
    async with AsyncClient(daemon.url, daemon.admin_key, timeout=600) as c:
        failures: list[errors.CellaError] = []

        async def one() -> object:
            try:
                sb = await c.create(**SMALL)
            except errors.CellaError as exc:  # a clear error, in cella's own terms
                failures.append(exc)
                return None
            assert (await sb.exec(["true"], timeout=300)).exit_code == 0
            return sb

        made = [sb for sb in await asyncio.gather(*(one() for _ in range(100))) if sb]
        assert len(made) + len(failures) == 100
        assert all(f.code and f.message for f in failures)
        assert not failures, [str(f) for f in failures[:3]]  # the host holds them all
        await asyncio.gather(*(sb.delete() for sb in made))  # type: ignore[attr-defined]
        assert await c.list() == []
        assert rows_not_deleted(daemon) == []
        await until(lambda: qemus_of(daemon) <= pooled(daemon), timeout=30)
        vms = daemon.data_dir / "vms"
        assert len(list(vms.iterdir())) <= pooled(daemon)


def test_the_sdk_drops_an_idle_connection_before_the_daemon_closes_it(daemon: Daemon) -> None:
    """The daemon closes a connection idle for 5 s (uvicorn's default); a request the client
    sends on it just then is never read: in a burst of 100, one create's first command was
    lost so. The SDK's pool lets an idle connection go after `IDLE_REUSE_SECONDS` (2 s):
    back to back, two calls share one connection (the control); 3 s apart, the second opens
    a new one (the daemon's log names each call's client port)."""

    def ports() -> list[str]:
        lines = daemon.log.read_text().splitlines()
        return [ln.split(" - ")[0].rsplit(":", 1)[1] for ln in lines if "GET /v1/health" in ln]

    before = len(ports())
    with daemon.client() as client:
        client.health()
        client.health()
        time.sleep(3)
        client.health()
    first, second, third = ports()[before:]
    assert first == second  # kept alive while it is used
    assert third != second  # let go once idle past 2 s, before the daemon's 5 s


async def test_the_next_fork_of_a_snapshot_loads_into_qemus_started_for_it(
    module_daemon_factory: DaemonFactory,
) -> None:
    """After a fork of three, three QEMUs wait for the snapshot's state; the next fork's
    branches load into them (their `forked` events say so), hold the parent's files and
    processes and are each their own, and as many as it had are kept for the one after;
    the first fork (nothing started yet) used none. Deleting the snapshot ends its spares:
    nothing is left behind."""
    d = module_daemon_factory("fork-spares", fork_spares="3", pool_size="0")

    def spares() -> int:  # the snapshot's: the only one this daemon holds
        held = health(d)["fork_spares"]
        assert isinstance(held, int)
        return held

    async with AsyncClient(d.url, d.admin_key, timeout=300) as c:
        parent = await c.create(**POOLED)
        await parent.files.write("/root/kept.txt", b"from the parent")
        await parent.exec(["sh", "-c", "sleep 1000 >/dev/null 2>&1 &"])
        snap = await parent.snapshot("spares")
        await parent.delete()

        async def used_spares(branches: list[AsyncSandbox]) -> int:
            events = [(await b.events(types=["forked"]))[0] for b in branches]
            return sum(1 for e in events if e.data["spare"])

        first = await snap.fork(3)
        assert await used_spares(first) == 0  # the control: nothing was started ahead yet
        await until(lambda: spares() == 3, timeout=60)

        second = await snap.fork(2)
        assert await used_spares(second) == 2
        for b in second:
            assert await b.files.read("/root/kept.txt") == b"from the parent"
            sleeping = await b.exec(["pgrep", "-x", "sleep"])
            assert sleeping.exit_code == 0  # the parent's process, restored
        await second[0].files.write("/root/mine.txt", b"one branch")
        missing = await second[1].exec(["test", "-e", "/root/mine.txt"])
        assert missing.exit_code == 1  # each branch is its own
        # made again, to the last fork's size: one was left, one more is started
        await until(lambda: spares() == 2, timeout=60)

        await asyncio.gather(*(b.delete() for b in [*first, *second]))
        await snap.delete()
        assert spares() == 0
        await until(lambda: qemus_of(d) == 0, timeout=30)
        assert list((d.data_dir / "vms").iterdir()) == []
