"""What the jail around QEMU costs: two daemons side by side, one with `jail = false`,
measured in one run, alternating, through the API.

    .venv/bin/python -m bench.jail [--creates 15] [--forks 10] [--rounds 3] [--json]

Creates restore from the warm snapshot (no pool), so each one starts a jailed QEMU (or an
unjailed one); a fork of N from a running sandbox starts N plus a snapshot helper. The
ratio column is jailed / unjailed p50.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._stats import report, summary_ms
from cella import Client
from tests.daemon import Daemon, kill_vms_of


def measure(creates: int, forks: int, rounds: int) -> dict[str, dict[str, Any]]:
    tmp = Path(tempfile.mkdtemp(prefix="cella-bench-jail-"))
    daemons = {
        "jailed": Daemon(tmp / "jailed", pool_size="0").start(),
        "unjailed": Daemon(tmp / "unjailed", pool_size="0", jail="false").start(),
    }
    times: dict[tuple[str, str], list[float]] = {}

    def note(kind: str, measure: str, seconds: float) -> None:
        times.setdefault((measure, kind), []).append(seconds)

    try:
        clients = {k: Client(d.url, d.admin_key) for k, d in daemons.items()}
        for _ in range(creates):  # alternating, so both see the same host load
            for kind, c in clients.items():
                t = time.perf_counter()
                sb = c.create()
                note(kind, "create by restore", time.perf_counter() - t)
                assert sb.info.created_from == "restore"
                t = time.perf_counter()
                sb.exec(["true"])
                note(kind, "first exec", time.perf_counter() - t)
                sb.delete()
        parents = {k: c.create() for k, c in clients.items()}
        for _ in range(rounds):
            for kind, parent in parents.items():
                t = time.perf_counter()
                branches = parent.fork(forks)
                note(kind, f"fork {forks} of a running sandbox", time.perf_counter() - t)
                for b in branches:
                    b.delete()
        for parent in parents.values():
            parent.delete()
        for c in clients.values():
            c.close()
    finally:
        for d in daemons.values():
            d.stop()
            kill_vms_of(d.data_dir)
    rows: dict[str, dict[str, Any]] = {}
    for measure in dict.fromkeys(m for m, _ in times):
        jailed = summary_ms(times[(measure, "jailed")])
        unjailed = summary_ms(times[(measure, "unjailed")])
        rows[f"{measure}, jailed"] = jailed
        rows[f"{measure}, unjailed"] = unjailed
        rows[f"{measure}, jailed"]["ratio"] = round(jailed["p50"] / unjailed["p50"], 2)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--creates", type=int, default=15)
    parser.add_argument("--forks", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = measure(args.creates, args.forks, args.rounds)
    report("the jail around QEMU: jailed vs unjailed, side by side", rows, args.json)


if __name__ == "__main__":
    main()
