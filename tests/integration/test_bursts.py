"""Bursts of creates against a real daemon: the warm pool grows to a burst's size and
shrinks back; admission queues a create for room and still refuses one past its deadline;
a burst of 100 leaves nothing behind; an idle kept-alive connection outlives the client's
own keep-alive, so no request is sent on one the daemon is closing."""

from __future__ import annotations

import asyncio
import socket
import sqlite3
import time

import httpx2
import pytest

from cella import AsyncClient, errors
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
        burst = await asyncio.gather(*(c.create(**POOLED) for _ in range(3)))
        # three at once: the pool grows to three (its max), once the creates went quiet
        await until(lambda: pooled(daemon) == 3)
        await asyncio.gather(*(sb.delete() for sb in burst))
        # no burst for pool_shrink_seconds: back to its size, the other two destroyed
        await until(lambda: pooled(daemon) == 1)
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


def test_an_idle_connection_outlives_the_clients_keep_alive(daemon: Daemon) -> None:
    """httpx's pools (the SDK's) reuse a connection idle for up to 5 s. Were the daemon to
    close idle ones after 5 s too (uvicorn's default), a request sent on one as it closes
    is lost: in a burst of 100 one create's first command was. The same socket answers a
    second request after 6 s idle (on a daemon that closes at 5 s the read ends empty)."""
    host, port = daemon.url.removeprefix("http://").split(":")
    request = f"GET /v1/health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        for idle in (0, 6):
            time.sleep(idle)
            conn.sendall(request)
            answer = read_response(conn)
            assert answer.startswith(b"HTTP/1.1 200"), (idle, answer[:100])


def read_response(conn: socket.socket) -> bytes:
    """One whole HTTP/1.1 response (headers and its Content-Length of body); empty if the
    other end closed the connection."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        body += conn.recv(65536)
    return data
