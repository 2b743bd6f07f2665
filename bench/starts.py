"""Fast starts, forks and pause, measured client-side through the API of real daemons.

    .venv/bin/python -m bench.starts [--creates 20] [--forks 10] [--json]

Two daemons run side by side: one with a warm pool, one without (creates restore from the
warm snapshot). Every figure is wall-clock from the client, on this host, in one run.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx2

from bench._stats import report, summary_ms
from cella import Client
from cella.config import DaemonSettings
from cella.paths import Paths
from cella.runtime.qemu.driver import QemuDriver
from cella.runtime.qemu.jail import jail_ids
from tests.daemon import Daemon, kill_vms_of
from tests.vms import qemu_of


def pool_full(d: Daemon) -> bool:
    h = httpx2.get(f"{d.url}/v1/health").json()
    return bool(h["pool"]) and all(n >= h["pool_size"] for n in h["pool"].values())


def wait(pred: Any, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError
        time.sleep(0.05)


def pss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1])
    return 0


def tcg_code_kib(pid: int) -> int:
    """PSS of QEMU's anonymous executable mappings: TCG's translated code, the part of a
    VM's memory that emulation adds and KVM does not have."""
    kib, executable = 0, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if not head[0].endswith(":"):  # a mapping: range, perms, offset, device, inode[, path]
            executable = "x" in head[1] and len(head) == 5
        elif executable and head[0] == "Pss:":
            kib += int(head[1])
    return kib


def disk_kib(path: Path) -> int:
    out = subprocess.run(["du", "-sk", str(path)], capture_output=True, text=True).stdout
    return int(out.split()[0])


def spare_up(d: Daemon) -> bool:
    h = httpx2.get(f"{d.url}/v1/health").json()
    return bool(h.get("spares")) and all(n >= 1 for n in h["spares"].values())


def timed(fn: Any) -> tuple[float, Any]:
    t = time.perf_counter()
    result = fn()
    return time.perf_counter() - t, result


def measure(creates: int, forks: int) -> dict[str, dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    tmp = Path(tempfile.mkdtemp(prefix="cella-bench-"))
    pooled = Daemon(tmp / "pooled", pool_size="2", pool_spares="0").start()
    plain = Daemon(tmp / "plain", pool_size="0", pool_spares="0").start()
    spared = Daemon(tmp / "spared", pool_size="0", pool_spares="1").start()
    try:
        with Client(pooled.url, pooled.admin_key) as c:
            from_pool, with_exec = [], []
            for _ in range(creates):
                wait(lambda: pool_full(pooled))
                t, sb = timed(c.create)
                assert sb.info.created_from == "pool"
                te, _ = timed(lambda sb=sb: sb.exec(["true"]))
                from_pool.append(t)
                with_exec.append(t + te)
                sb.delete()
            rows["create from the pool"] = {**summary_ms(from_pool), "target": "p50<=20 p99<=80"}
            rows["create + first exec (pool)"] = {**summary_ms(with_exec), "target": "p50<=150"}

        with Client(plain.url, plain.admin_key) as c:
            restored = []
            for _ in range(creates):
                t, sb = timed(c.create)
                assert sb.info.created_from == "restore"
                restored.append(t)
                sb.delete()
            rows["create by restore (empty pool)"] = {**summary_ms(restored), "target": "p50<=80"}

            with Client(spared.url, spared.admin_key) as cs:
                cs.create().delete()  # the pool's shape is watched from a first create on
                finished = []
                for _ in range(creates):
                    wait(lambda: spare_up(spared))
                    t, sb = timed(cs.create)
                    assert sb.events(types=["created"])[0].data["spare"] is True
                    finished.append(t)
                    sb.delete()
                rows["create by restore, a spare QEMU up"] = {
                    **summary_ms(finished),
                    "target": "p50<=80",
                }

            for mib in (200, 10):  # the 10 MiB parent's branches are measured below
                parent = c.create()
                # written since its restore: tmpfs pages are guest RAM
                parent.exec(f"head -c {mib}M /dev/urandom > /dev/shm/dirt")
                t, branches = timed(lambda parent=parent: parent.fork(forks))
                snap = c.snapshots()[-1]
                rows[f"fork {forks} of a running sandbox, {mib} MiB dirtied"] = {
                    **summary_ms([t]),
                    "target": "<=1000" if mib == 10 else "",
                }
                rows[f"  parent paused ({mib} MiB dirtied)"] = {
                    **summary_ms([(snap.info.paused_ms or 0) / 1000]),
                    "target": "<=150" if mib == 10 else "",
                }
                if mib != 10:
                    for b in branches:
                        b.delete()
                    parent.delete()
                    for s in c.snapshots():
                        s.delete()
            time.sleep(2)  # let the branches settle idle
            pids = [qemu_of(b.id) for b in branches]
            pss = [pss_kib(p) for p in pids]
            untranslated = [pss_kib(p) - tcg_code_kib(p) for p in pids]
            disk = [disk_kib(plain.data_dir / "vms" / b.id) for b in branches]
            rows["  PSS per idle branch (MiB)"] = {
                "n": len(pss),
                "p50": round(sorted(pss)[len(pss) // 2] / 1024, 1),
                "max": round(max(pss) / 1024, 1),
                "target": "<=20",
            }
            rows["  the same without TCG's translated code (MiB)"] = {
                "n": len(untranslated),
                "p50": round(sorted(untranslated)[len(untranslated) // 2] / 1024, 1),
                "max": round(max(untranslated) / 1024, 1),
                "target": "<=20",
            }
            rows["  disk per idle branch (MiB)"] = {
                "n": len(disk),
                "p50": round(sorted(disk)[len(disk) // 2] / 1024, 2),
                "max": round(max(disk) / 1024, 2),
                "target": "<=1",
            }
            for b in branches:
                b.delete()
            t, more = timed(lambda: snap.fork(forks))
            rows[f"fork {forks} from a snapshot"] = {**summary_ms([t]), "target": "<=800"}
            for b in more:
                b.delete()
            parent.delete()

            for mem in (256, 1024):
                sb = c.create(memory_mib=mem)
                pauses, resumes = [], []
                for _ in range(5):
                    tp, _ = timed(sb.pause)
                    tr, _ = timed(sb.resume)
                    pauses.append(tp)
                    resumes.append(tr)
                rows[f"pause at {mem} MiB"] = summary_ms(pauses)
                rows[f"resume at {mem} MiB"] = {**summary_ms(resumes), "target": "<=100"}
                sb.delete()
    finally:
        for d in (pooled, plain, spared):
            d.stop()
            kill_vms_of(d.data_dir)

    async def cold() -> list[float]:
        driver = QemuDriver(
            Paths.default(), jail=jail_ids(DaemonSettings())
        )  # as the daemon runs it
        times = []
        for _ in range(3):
            vm = await driver.boot()
            times.append(vm.boot_seconds or 0.0)
            await driver.destroy(vm)
        return times

    rows["cold boot (reference)"] = summary_ms(asyncio.run(cold()))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--creates", type=int, default=20)
    parser.add_argument("--forks", type=int, default=10)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    report(
        "cella fast starts (client-side, through the API)",
        measure(args.creates, args.forks),
        args.json,
    )


if __name__ == "__main__":
    main()
