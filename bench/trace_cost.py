"""The cost of the process trace: `exec true` and a 200-process shell loop, each in a
sandbox with the trace on and one with it off (`exec_defaults.trace_processes`), in one run,
interleaved so both see the same host. Timed client-side through the REST API.

    .venv/bin/python -m bench.trace_cost [--runs 20] [--json]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from bench._stats import report, summary_ms
from cella import Client, Sandbox
from cella.models import ExecDefaults
from tests.daemon import Daemon, kill_vms_of

LOOP = "i=0; while [ $i -lt 200 ]; do /bin/true; i=$((i+1)); done"


def timed(sb: Sandbox, command: str) -> float:
    start = time.perf_counter()
    sb.exec(command, check=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="cella-trace-"))
    d = Daemon(base / "d", pool_size="0").start()
    try:
        with Client(d.url, d.admin_key) as c:
            on = c.create()
            off = c.create(exec_defaults=ExecDefaults(trace_processes=False))
            cases = {"exec true": "true", "200-process shell loop": LOOP}
            times: dict[str, list[float]] = {}
            for name, command in cases.items():
                for sb in (on, off):  # warm the translation cache of both
                    timed(sb, command)
                for _ in range(args.runs):
                    for label, sb in (("on", on), ("off", off)):
                        times.setdefault(f"{name}, trace {label}", []).append(timed(sb, command))
            rows = {name: summary_ms(values) for name, values in times.items()}
            for name in cases:
                traced, plain = rows[f"{name}, trace on"], rows[f"{name}, trace off"]
                traced["ratio"] = round(traced["p50"] / plain["p50"], 2)
            loop_tree = on.process_trees(on.events(types=["exec"])[-1].id)
            rows["200-process shell loop, trace on"]["processes"] = (
                loop_tree[0].summary or {}
            ).get("total", "?")
            report("process trace cost (ratio: p50 on / p50 off)", rows, args.json)
            on.delete()
            off.delete()
    finally:
        d.stop()
        kill_vms_of(base / "d")


if __name__ == "__main__":
    main()
