"""Density: N idle sandboxes at once, and what they cost the host.

    .venv/bin/python -m bench.idle [--count 300] [--json]

RAM is committed nominally (memory_mib each) but shared through the snapshot's RAM file, so
this run raises the daemon's commitment limit on purpose: that is an operator's choice.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench._stats import report, summary_ms
from bench.starts import pss_kib
from cella import Client
from tests.daemon import Daemon, kill_vms_of
from tests.vms import qemu_pids


def mem_available_mib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) // 1024
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--count", type=int, default=300)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    d = Daemon(
        Path(tempfile.mkdtemp(prefix="cella-idle-")) / "d",
        pool_size="0",
        max_host_memory_mib=str(1 << 30),
        max_host_vcpus=str(1 << 20),
        max_sandboxes_per_tenant=str(args.count + 10),
    ).start()
    rows: dict[str, dict[str, object]] = {}
    try:
        with Client(d.url, d.admin_key, timeout=600) as c:
            before = mem_available_mib()
            creates, sandboxes = [], []
            for _ in range(args.count):
                t = time.perf_counter()
                sandboxes.append(c.create(memory_mib=512))
                creates.append(time.perf_counter() - t)
            time.sleep(10)  # let them settle idle
            pids = [
                p
                for p in qemu_pids()
                if str(d.data_dir)
                in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")
            ]
            pss = [pss_kib(p) / 1024 for p in pids]
            load1 = os.getloadavg()[0]
            used = before - mem_available_mib()
            sample = sandboxes[:: max(1, len(sandboxes) // 20)]
            rtt = []
            for sb in sample:
                t = time.perf_counter()
                assert sb.exec("echo ok").stdout == b"ok\n"
                rtt.append(time.perf_counter() - t)
            rows[f"create {args.count} sandboxes (restore)"] = summary_ms(creates)
            rows["exec in a sample of them"] = summary_ms(rtt)
            rows["VMs running"] = {"n": len(pids)}
            rows["PSS per VM (MiB)"] = {
                "n": len(pss),
                "p50": round(statistics.median(pss), 1),
                "max": round(max(pss), 1),
            }
            rows["host RAM used by all (MiB)"] = {"n": len(pids), "p50": used}
            rows["load average (1 min)"] = {"n": 1, "p50": round(load1, 2)}
            for sb in sandboxes:
                sb.delete()
    finally:
        d.stop()
        kill_vms_of(d.data_dir)
    report(f"{args.count} idle sandboxes on this host", rows, args.json)


if __name__ == "__main__":
    main()
