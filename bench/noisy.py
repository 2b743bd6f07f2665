"""A noisy neighbour: a neighbour's exec round trip with a CPU burner in another sandbox,
as a ratio to the same measure with that sandbox idle, in one run.

    .venv/bin/python -m bench.noisy [--execs 60] [--json]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from bench._stats import report, summary_ms
from cella import Client
from tests.daemon import Daemon, kill_vms_of


def rtts(sb: object, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        sb.exec(["true"])  # type: ignore[attr-defined]
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--execs", type=int, default=60)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    d = Daemon(Path(tempfile.mkdtemp(prefix="cella-noisy-")) / "d", pool_size="0").start()
    try:
        with Client(d.url, d.admin_key) as c:
            burner, neighbour = c.create(vcpus=1), c.create(vcpus=1)
            rtts(neighbour, 10)  # warm
            quiet = rtts(neighbour, args.execs)
            burner.exec("for i in 1 2 3 4; do (while :; do :; done) & done")
            time.sleep(1)
            loud = rtts(neighbour, args.execs)
            burner.exec("pkill -f 'while' || true")
            ratio = statistics.median(loud) / statistics.median(quiet)
            rows = {
                "neighbour exec, burner idle": summary_ms(quiet),
                "neighbour exec, burner at 100%": summary_ms(loud),
                "ratio of p50s": {"n": 1, "p50": round(ratio, 2)},
            }
            burner.delete()
            neighbour.delete()
    finally:
        d.stop()
        kill_vms_of(d.data_dir)
    report("noisy neighbour (1-vCPU sandboxes, host CPU cgroups on)", rows, args.json)


if __name__ == "__main__":
    main()
