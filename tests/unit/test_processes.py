"""The processes room's bounds, in process, against the fake runtime: how many processes a
sandbox and a tenant keep, how many output bytes, and for how long. (The same bounds hold
against a real daemon in tests/integration/test_langsmith.py.)"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest

from cella import errors
from cella.config import DaemonSettings
from cella.models import ExecRequest, SandboxCreate
from cella.policy.access import Principal
from cella.service.daemon import Daemon
from cella.service.processes import OutputBuffer, Processes, ProcessLimits, ProcessSpec
from cella.store import Store
from tests.unit.fake_runtime import FakeDriver, FakeVM


@pytest.fixture
async def daemon(tmp_path: Path) -> AsyncIterator[Daemon]:
    settings = DaemonSettings(data_dir=tmp_path, image_dir=tmp_path / "images", pool_size=0)
    d = Daemon(settings, Store(tmp_path / "cella.db"), FakeDriver(tmp_path))
    yield d
    await d.processes.close()
    await d.registry.detach_all()
    d.store.close()


async def sandbox(d: Daemon, tenant: str = "t") -> str:
    row = await d.lifecycle.create(Principal.service(tenant), SandboxCreate())
    vm = d.registry.vm(row.id)
    assert isinstance(vm, FakeVM)

    async def prints(argv: Sequence[str] | str) -> tuple[int, bytes, bytes]:
        """`n:c` prints n bytes of c; `wait` runs until the test's gate opens."""
        word = argv if isinstance(argv, str) else argv[-1]
        if word == "wait":
            await GATES[row.id].wait()
            return 0, b"", b""
        n, _, c = word.partition(":")
        return 0, c.encode() * int(n), b""

    GATES[row.id] = asyncio.Event()
    vm.agent.handler = prints
    return row.id


GATES: dict[str, asyncio.Event] = {}
T = Principal.service("t")  # tenant t's owner


def room(d: Daemon, limits: ProcessLimits) -> Processes:
    """A processes room with these limits, told of deleted sandboxes like the daemon's."""
    procs = Processes(d.exec, limits)
    d.registry.forget_hooks.append(procs.forget)
    return procs


async def run(procs: Processes, sandbox_id: str, pid: str, word: str, tenant: str = "t") -> None:
    """Starts `word` as process `pid` and waits for it to end."""
    spec = ProcessSpec(request=ExecRequest(command=[word]), ttl=None)
    proc = await procs.start(Principal.service(tenant), sandbox_id, pid, spec)
    async for _ in proc.follow():
        pass


def kept(procs: Processes, sandbox_id: str, tenant: str = "t") -> dict[str, int]:
    return {p.id: p.kept for p in procs.list(Principal.service(tenant), sandbox_id)}


def test_a_buffer_drops_its_oldest_bytes_and_keeps_offsets() -> None:
    buffer = OutputBuffer(cap=10)
    assert buffer.append(b"0123456789ab") == 10  # over its cap: the latest 10
    assert (buffer.start, buffer.end, bytes(buffer.data)) == (2, 12, b"23456789ab")
    assert buffer.drop(3) == 3 and buffer.since(0) == (5, b"56789ab")
    assert buffer.drop(100) == 7 and buffer.since(0) == (12, b"")


async def test_output_over_the_sandbox_bound_drops_the_longest_ended_first(
    daemon: Daemon,
) -> None:
    procs = room(daemon, ProcessLimits(sandbox_bytes=1000, tenant_bytes=10_000))
    sb = await sandbox(daemon)
    await run(procs, sb, "p1", "400:a")
    await run(procs, sb, "p2", "400:b")
    assert kept(procs, sb) == {"p1": 400, "p2": 400}  # the control: under it, all kept
    await run(procs, sb, "p3", "400:c")
    assert kept(procs, sb) == {"p1": 200, "p2": 400, "p3": 400}
    assert procs.get(T, sb, "p1").buffers["stdout"].since(0) == (200, b"a" * 200)  # latest
    await run(procs, sb, "p4", "600:d")
    assert kept(procs, sb) == {"p1": 0, "p2": 0, "p3": 400, "p4": 600}
    assert procs.kept(("sandbox", sb)) == procs.kept(("tenant", "t")) == 1000


async def test_a_writer_alone_over_the_bound_keeps_its_latest_bytes(daemon: Daemon) -> None:
    procs = room(daemon, ProcessLimits(sandbox_bytes=1000))
    sb = await sandbox(daemon)
    await run(procs, sb, "big", "1500:x")
    buffer = procs.get(T, sb, "big").buffers["stdout"]
    assert (buffer.start, buffer.end) == (500, 1500)
    assert procs.kept(("sandbox", sb)) == 1000


async def test_the_tenant_bound_spans_its_sandboxes(daemon: Daemon) -> None:
    procs = room(daemon, ProcessLimits(sandbox_bytes=1000, tenant_bytes=1500))
    first, second = await sandbox(daemon), await sandbox(daemon)
    other = await sandbox(daemon, "u")
    await run(procs, first, "p1", "800:a")
    await run(procs, other, "q1", "900:z", tenant="u")  # another tenant's count apart
    await run(procs, second, "p2", "900:b")
    assert kept(procs, first) == {"p1": 600} and kept(procs, second) == {"p2": 900}
    assert procs.kept(("tenant", "t")) == 1500 and kept(procs, other, "u") == {"q1": 900}
    await daemon.lifecycle.delete(T, first)  # a deleted sandbox's output is uncounted
    assert procs.kept(("tenant", "t")) == 900 and procs.kept(("sandbox", first)) == 0


async def test_a_start_over_the_count_evicts_the_longest_ended_or_is_refused(
    daemon: Daemon,
) -> None:
    procs = room(daemon, ProcessLimits(per_sandbox=2, per_tenant=3))
    sb, sb2 = await sandbox(daemon), await sandbox(daemon)
    await run(procs, sb, "p1", "1:a")
    await run(procs, sb, "p2", "1:b")
    await run(procs, sb, "p3", "1:c")
    assert sorted(kept(procs, sb)) == ["p2", "p3"]  # p1 ended first: it made room
    with pytest.raises(errors.NotFound):
        procs.get(T, sb, "p1")
    await run(procs, sb2, "q1", "1:a")
    await run(procs, sb2, "q2", "1:a")  # the tenant's third and fourth: p2 made room
    assert sorted(kept(procs, sb)) == ["p3"] and sorted(kept(procs, sb2)) == ["q1", "q2"]

    spec = ProcessSpec(request=ExecRequest(command=["wait"]))
    await procs.start(T, sb, "w1", spec)
    await procs.start(T, sb, "w2", spec)  # p3 made room; both run now
    with pytest.raises(errors.QuotaExceeded, match="max_processes_per_sandbox"):
        await procs.start(T, sb, "w3", spec)
    assert sorted(kept(procs, sb)) == ["w1", "w2"]  # nothing was evicted for the refusal
    assert (await procs.start(T, sb, "w1", spec)).id == "w1"  # attaching needs no room
    GATES[sb].set()
    for pid in ("w1", "w2"):
        async for _ in procs.get(T, sb, pid).follow():
            pass
    await run(procs, sb, "w3", "1:a")  # the control: room again once one ended


async def test_an_ended_process_is_kept_at_most_the_longest_the_daemon_allows(
    daemon: Daemon,
) -> None:
    procs = room(daemon, ProcessLimits(keep_seconds=60))
    sb = await sandbox(daemon)
    await run(procs, sb, "forever", "1:a")  # ttl None: as long as allowed
    short = ProcessSpec(request=ExecRequest(command=["1:b"]), ttl=5)
    proc = await procs.start(T, sb, "short", short)
    async for _ in proc.follow():
        pass
    await procs.sweep(time.monotonic() + 30)
    assert sorted(kept(procs, sb)) == ["forever"]  # its own TTL was shorter
    await procs.sweep(time.monotonic() + 61)
    assert kept(procs, sb) == {} and procs.kept(("tenant", "t")) == 0


def test_the_limits_come_from_the_daemon_settings(tmp_path: Path) -> None:
    settings = DaemonSettings(
        data_dir=tmp_path,
        max_processes_per_sandbox=3,
        max_processes_per_tenant=9,
        max_process_output_mib_per_sandbox=2,
        max_process_output_mib_per_tenant=5,
        max_process_keep_seconds=7,
    )
    assert ProcessLimits.of(settings) == ProcessLimits(3, 9, 2 << 20, 5 << 20, 7.0)
