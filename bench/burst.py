"""Bursts and throughput through the public async SDK against a real daemon: N simultaneous
creates each followed by its first command, creates per second sustained, fork(N) of a
snapshot, the daemon's own CPU time per create and per first exec, and where a create's
time goes under load (the spans of its `created` event, the pool's work from /metrics).

    .venv/bin/python -m bench.burst [--bursts 10,30,100] [--forks 10,30,100] [--seconds 60]
                                    [--pool-max 30] [--compare /tmp/base/src] [--json]

`--compare SRC` runs the same phases, back to back, against a daemon from another checkout's
`src` (e.g. `git worktree add /tmp/base main`) and prints each figure's ratio: the host is
shared, so only figures of one run are compared. Every burst and fork runs twice, the
second finding the pool grown by the first (`--pool-max`, the daemon's `pool_max_size`) or
forking the same snapshot again. Sandboxes are the pool's shape (1 vCPU,
512 MiB); the daemon's memory commitment is raised to fit the largest burst (what they
really take is measured: PSS per idle branch in `bench.starts`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx2

from bench._stats import pct, report
from cella import AsyncClient
from tests.daemon import Daemon, kill_vms_of
from tests.vms import qemu_of, qemu_pids

SHAPE = {"vcpus": 1, "memory_mib": 512}  # the shape the warm pool serves
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU of one process (not its children: QEMU's is the guest's)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def host_busy_seconds() -> float:
    """CPU time all of the host's cores spent busy so far (/proc/stat): what the daemon and
    its QEMUs do not account for is other processes' (egress proxies, the kernel's)."""
    fields = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle and iowait
    return (sum(fields[:8]) - idle) / TICK


def pool_work(d: Daemon) -> dict[str, float]:
    """The daemon's `cella_pool_work` gauges (absent on a daemon that has none)."""
    work: dict[str, float] = {}
    auth = {"Authorization": f"Bearer {d.admin_key}"}
    for line in httpx2.get(f"{d.url}/metrics", headers=auth).text.splitlines():
        if line.startswith("cella_pool_work{"):
            kind = line.split('kind="', 1)[1].split('"', 1)[0]
            work[kind] = float(line.rsplit(" ", 1)[1])
    return work


def pool_state(url: str) -> tuple[bool, dict[str, int]]:
    """Whether every pool is filled to its target (its resting size, or more after a
    burst; a daemon that does not say its target: its resting size), and what it holds."""
    h = httpx2.get(f"{url}/v1/health").json()
    target = h.get("pool_target", {})
    full = bool(h["pool"]) and all(
        n >= target.get(shape, h["pool_size"]) for shape, n in h["pool"].items()
    )
    return full and "pool_target" in h, dict(h["pool"])


async def settle(url: str, timeout: float = 120) -> None:
    """Until the pool is full again (for a daemon that does not say what a burst grew it
    to: until it stopped growing for 3 s): each phase starts from the same state."""
    deadline = time.monotonic() + timeout
    last, still_since = None, time.monotonic()
    while time.monotonic() < deadline:
        full, held = pool_state(url)
        if full:
            return
        if held != last:
            last, still_since = held, time.monotonic()
        elif held and time.monotonic() - still_since > 3:
            return
        await asyncio.sleep(0.1)


def busy_share(seconds: float = 2.0) -> float:
    """The share of the host's cores busy over `seconds` (1.0 = all of them): the host is
    shared, and the 1-minute load average still counts a heavy run that just ended."""
    before = host_busy_seconds()
    time.sleep(seconds)
    return round((host_busy_seconds() - before) / seconds / (os.cpu_count() or 1), 2)


async def gone(sb: Any) -> None:
    """Deletes a sandbox; once more if the connection dropped under it (a kept-alive
    connection the server closed as it was reused)."""
    try:
        await sb.delete()
    except httpx2.TransportError:
        await sb.delete()


def ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


def median(values: list[float]) -> float:
    return round(statistics.median(values), 1) if values else 0.0


async def burst(c: AsyncClient, d: Daemon, n: int) -> dict[str, float]:
    """N creates at once, each then runs `true`; what the client saw and the daemon spent."""
    assert d.proc is not None
    work0, cpu0, host0 = pool_work(d), cpu_seconds(d.proc.pid), host_busy_seconds()
    t0 = time.perf_counter()
    created: list[float] = []
    answered: list[float] = []
    errors: dict[str, list[str]] = {"create": [], "first exec": []}

    async def one() -> Any:
        t = time.perf_counter()
        try:
            sb = await c.create(**SHAPE)
        except Exception as exc:
            errors["create"].append(repr(exc)[:200])
            return None
        created.append(time.perf_counter() - t)
        te = time.perf_counter()
        try:  # a failed first command keeps its sandbox: it is deleted below like the rest
            r = await sb.exec(["true"], timeout=300)
            assert r.exit_code == 0, r
            answered.append(time.perf_counter() - te)
        except Exception as exc:
            errors["first exec"].append(repr(exc)[:200])
        return sb

    made = [sb for sb in await asyncio.gather(*(one() for _ in range(n))) if sb]
    wall = time.perf_counter() - t0
    cpu = cpu_seconds(d.proc.pid) - cpu0
    host_busy = host_busy_seconds() - host0
    # the guest's side: its QEMU's CPU from restore to first command answered (a pooled
    # VM's includes its restore and warm-up before the burst), the emulation's bound
    guest = [cpu_seconds(qemu_of(sb.id)) for sb in made]
    work = pool_work(d)
    spans: dict[str, list[float]] = {}
    exec_ms: list[float] = []
    for sb in made:
        for e in await sb.events(types=["created", "exec"]):
            if e.type == "created":
                for k, v in e.data.items():
                    if k.endswith("_ms"):
                        spans.setdefault(k, []).append(float(v))
            elif e.type == "exec":
                exec_ms.append(float(e.data["duration_ms"]))
    await asyncio.gather(*(gone(sb) for sb in made))
    for step, failed in errors.items():
        if failed:
            print(f"burst {n}: {len(failed)} {step} errors, e.g. {failed[0]}")
    row = {
        "created": len(made),
        "first commands answered": len(answered),
        "create p50 (ms)": ms(statistics.median(created)) if created else 0.0,
        "create p99 (ms)": ms(pct(created, 99)) if created else 0.0,
        "first exec p50 (ms)": ms(statistics.median(answered)) if answered else 0.0,
        "all answered (ms)": ms(wall),
        "daemon CPU per sandbox (ms)": ms(cpu / max(1, n)),
        "QEMU CPU per sandbox p50 (ms)": ms(statistics.median(guest)) if guest else 0.0,
        "all QEMU CPU / cores (ms)": ms(sum(guest) / (os.cpu_count() or 1)),
        "host CPU busy / cores (ms)": ms(host_busy / (os.cpu_count() or 1)),
        "from the pool": work.get("claimed", 0) - work0.get("claimed", 0),
        "pool refills during": work.get("refills", 0) - work0.get("refills", 0),
        "pool refill seconds during": round(
            work.get("refill_seconds", 0) - work0.get("refill_seconds", 0), 2
        ),
        "daemon: exec in guest p50 (ms)": median(exec_ms),
    }
    for k, values in spans.items():
        row[f"daemon: {k.removesuffix('_ms')} p50 (ms)"] = median(values)
    return row


async def sustained(c: AsyncClient, seconds: float, workers: int) -> dict[str, float]:
    """Create + first exec + delete in a loop by `workers` clients at once."""
    done = 0
    failed = 0
    stop = time.perf_counter() + seconds

    async def loop() -> None:
        nonlocal done, failed
        while time.perf_counter() < stop:
            try:
                sb = await c.create(**SHAPE)
                await sb.exec(["true"])
                await gone(sb)
                done += 1
            except Exception:
                failed += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(workers)))
    return {"per second": round(done / (time.perf_counter() - t0), 2), "failed": failed}


async def cpu_per_call(c: AsyncClient, d: Daemon, n: int = 10) -> dict[str, float]:
    """The daemon's CPU per create and per first exec, one at a time (nothing else runs)."""
    assert d.proc is not None
    cpu0 = cpu_seconds(d.proc.pid)
    made = [await c.create(**SHAPE) for _ in range(n)]
    cpu1 = cpu_seconds(d.proc.pid)
    for sb in made:
        await sb.exec(["true"])
    cpu2 = cpu_seconds(d.proc.pid)
    for sb in made:
        await gone(sb)
    return {"per create (ms)": ms((cpu1 - cpu0) / n), "per first exec (ms)": ms((cpu2 - cpu1) / n)}


async def spares_ready(url: str, n: int, timeout: float = 120) -> None:
    """Until the daemon holds `n` QEMUs started for the next fork (of the one snapshot it
    forked; a daemon without them: at once), as a harness finds them after its rollouts."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        held = httpx2.get(f"{url}/v1/health").json().get("fork_spares")
        if held is None or held >= n:
            return
        await asyncio.sleep(0.1)


async def new_snapshot(c: AsyncClient) -> Any:
    """A snapshot of a fresh sandbox (which is deleted): what `fork(N)` rows fork."""
    parent = await c.create(**SHAPE)
    snap = await parent.snapshot("burst")
    await parent.delete()
    return snap


async def forks(c: AsyncClient, d: Daemon, n: int, snap: Any, last: bool) -> dict[str, float]:
    """fork(N) of a snapshot (deleted after the `last` fork of it); the CPU it took in the
    daemon and in the branches' QEMUs (their start, state load and first guest answers:
    the emulation's bound), and in the rest of the host. A branch that loaded into a spare
    QEMU counts that QEMU's start too, paid before the fork: there the QEMU rows hold more
    than the fork's window, and the rest of the host's share comes out too small."""
    assert d.proc is not None
    cpu0, host0 = cpu_seconds(d.proc.pid), host_busy_seconds()
    t = time.perf_counter()
    branches = await snap.fork(n)
    took = time.perf_counter() - t
    daemon_cpu = cpu_seconds(d.proc.pid) - cpu0
    host_busy = host_busy_seconds() - host0
    guest = [cpu_seconds(qemu_of(b.id)) for b in branches]
    results = await asyncio.gather(*(b.exec(["true"]) for b in branches), return_exceptions=True)
    answering = sum(1 for r in results if not isinstance(r, BaseException) and r.exit_code == 0)
    spans: dict[str, list[float]] = {}  # where a clone's time went, from its `forked` event
    for b in branches:
        for e in await b.events(types=["forked"]):
            for k, v in e.data.items():
                if k.endswith("_ms"):
                    spans.setdefault(k, []).append(float(v))
    await asyncio.gather(*(gone(b) for b in branches))
    if last:
        await snap.delete()
    row = {
        "total (ms)": ms(took),
        "per clone (ms)": ms(took / n),
        "answering": answering,
        "daemon CPU per clone (ms)": ms(daemon_cpu / n),
        "QEMU CPU per clone p50 (ms)": ms(statistics.median(guest)),
        "all QEMU CPU / cores, per clone (ms)": ms(sum(guest) / (os.cpu_count() or 1) / n),
        "host CPU busy / cores, per clone (ms)": ms(host_busy / (os.cpu_count() or 1) / n),
        "other processes' CPU per clone (ms)": ms((host_busy - daemon_cpu - sum(guest)) / n),
    }
    for k, values in spans.items():
        row[f"daemon: {k.removesuffix('_ms')} p50 (ms)"] = median(values)
    return row


def leftovers(d: Daemon) -> int:
    vms = d.data_dir / "vms"
    dirs = len(list(vms.iterdir())) if vms.exists() else 0
    from cella.runtime.qemu.vm import qemu_cmdline

    procs = sum(1 for p in qemu_pids() if f"{d.data_dir}/vms/" in " ".join(qemu_cmdline(p)))
    h = httpx2.get(f"{d.url}/v1/health").json()
    # every phase deleted what it made: a sandbox still listed was left behind too
    auth = {"Authorization": f"Bearer {d.admin_key}"}
    live = len(httpx2.get(f"{d.url}/v1/sandboxes", headers=auth).json()["sandboxes"])
    kept = sum(h["pool"].values()) + sum(h.get("spares", {}).values())
    return live + max(0, dirs - kept) + max(0, procs - kept)


async def measure(
    src: str | None, bursts: list[int], fork_counts: list[int], seconds: float, pool_max: int
) -> dict[str, float]:
    """Every phase against one daemon (run from `src` if given); flat figures. Each burst
    and fork runs twice: first as it finds the daemon (a pool at its resting size, a new
    snapshot), then again (the pool grown by the burst before, as a harness that sends
    batch after batch finds it; the same snapshot forked again once QEMUs were started
    for it, as RL rollouts fork one snapshot batch after batch)."""
    largest = max([*bursts, *fork_counts, 1])
    settings = {
        "pool_spares": "1",  # the daemon's defaults (the test daemon's are 0)
        "admission_wait_seconds": "2",
        "pool_max_size": str(pool_max),
        # QEMUs started ahead for a snapshot's next fork: one per branch of the largest
        "fork_spares": str(max([*fork_counts, 1])),
        "max_host_memory_mib": str((largest + 8) * SHAPE["memory_mib"]),
        "max_sandboxes_per_tenant": str(largest + 8),
    }
    # the shared host's load before this run's daemon starts: others' work
    out: dict[str, float] = {"host factor (cores busy before the run)": busy_share()}
    old = os.environ.get("PYTHONPATH")
    if src:
        os.environ["PYTHONPATH"] = src
    tmp = Path(tempfile.mkdtemp(prefix="cella-burst-"))
    d = Daemon(tmp / "d", **settings)
    try:
        d.start()
    finally:
        if src:
            os.environ["PYTHONPATH"] = old or ""
    try:
        async with AsyncClient(d.url, d.admin_key, timeout=900) as c:
            await (await c.create(**SHAPE)).delete()  # the pool of this shape is watched
            await settle(d.url)
            phases: list[tuple[str, Any]] = [("daemon CPU", lambda: cpu_per_call(c, d))]
            for n in bursts:
                phases.append((f"burst {n}:", lambda n=n: burst(c, d, n)))
                phases.append((f"burst {n} again:", lambda n=n: burst(c, d, n)))
            phases.append(
                ("sustained create+exec+delete, 4 clients:", lambda: sustained(c, seconds, 4))
            )
            snaps: dict[int, Any] = {}

            async def fork(n: int, again: bool) -> dict[str, float]:
                if not again:
                    snaps[n] = await new_snapshot(c)
                else:
                    await spares_ready(d.url, n)
                return await forks(c, d, n, snaps[n], last=again)

            for n in fork_counts:
                phases.append((f"fork {n} of a snapshot:", lambda n=n: fork(n, False)))
                phases.append((f"fork {n} of it again:", lambda n=n: fork(n, True)))
            for name, phase in phases:
                await settle(d.url)
                try:
                    for k, v in (await phase()).items():
                        out[f"{name} {k}"] = v
                except Exception as exc:  # one phase's failure is a figure too
                    print(f"{name} failed: {exc!r}"[:300])
                    out[f"{name} failed"] = 1
            await asyncio.sleep(1)
            out["left behind (sandboxes listed, VM dirs and QEMUs beyond the pool)"] = leftovers(d)
    finally:
        d.stop()
        kill_vms_of(d.data_dir)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--bursts", default="10,30,100")
    parser.add_argument("--forks", default="10,30,100")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument(
        "--pool-max", type=int, default=30, help="pool_max_size: how far a burst grows the pool"
    )
    parser.add_argument("--compare", help="another checkout's src, measured first")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    bursts = [int(n) for n in args.bursts.split(",") if n]
    fork_counts = [int(n) for n in args.forks.split(",") if n]
    base = (
        asyncio.run(measure(args.compare, bursts, fork_counts, args.seconds, args.pool_max))
        if args.compare
        else None
    )
    this = asyncio.run(measure(None, bursts, fork_counts, args.seconds, args.pool_max))
    rows: dict[str, dict[str, Any]] = {}
    for k, v in this.items():
        row: dict[str, Any] = {"this": v}
        if base is not None:
            b = base.get(k)
            row["base"] = "" if b is None else b
            row["this/base"] = round(v / b, 2) if b else ""
        rows[k] = row
    if base is not None:
        for k, b in base.items():
            rows.setdefault(k, {"this": "", "base": b, "this/base": ""})
    title = "bursts and throughput (client-side through the async SDK; daemon spans)"
    report(title, rows, args.json)


if __name__ == "__main__":
    main()
