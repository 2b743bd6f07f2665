"""Checkpoints: how long one takes after 10 MiB and 200 MiB were dirtied (written to a file:
the guest's page cache and its disk), how long the sandbox was paused for it, a rewind,
and a diff against the sandbox as it is now.

    .venv/bin/python -m bench.checkpoints [--rounds 3] [--json]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from bench._stats import report, summary_ms
from cella import Client
from tests.daemon import Daemon, kill_vms_of

SIZES_MIB = (10, 200)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    d = Daemon(Path(tempfile.mkdtemp(prefix="cella-checkpoints-")) / "d", pool_size="0").start()
    rows: dict[str, dict[str, object]] = {}
    try:
        with Client(d.url, d.admin_key, timeout=600) as c, c.create(memory_mib=1024) as sb:
            sb.checkpoint("base")
            for size in SIZES_MIB:
                took, paused, rewinds, diffs = [], [], [], []
                for n in range(args.rounds):
                    sb.exec(f"head -c {size}M /dev/urandom > /root/dirty-{size}-{n}", check=True)
                    t = time.perf_counter()
                    cp = sb.checkpoint(f"d{size}-{n}")
                    took.append(time.perf_counter() - t)
                    paused.append((cp.paused_ms or 0) / 1000)
                    sb.exec(f"rm /root/dirty-{size}-{n}", check=True)
                    t = time.perf_counter()
                    diff = sb.diff(cp)
                    diffs.append(time.perf_counter() - t)
                    assert any(ch.path == f"/root/dirty-{size}-{n}" for ch in diff.changes)
                    t = time.perf_counter()
                    sb.rewind(cp)
                    rewinds.append(time.perf_counter() - t)
                    assert sb.files.exists(f"/root/dirty-{size}-{n}")
                rows[f"checkpoint, {size} MiB dirtied"] = summary_ms(took)
                rows[f"  of which paused, {size} MiB"] = summary_ms(paused)
                rows[f"diff to now, {size} MiB"] = summary_ms(diffs)
                rows[f"rewind, {size} MiB dirtied"] = summary_ms(rewinds)
    finally:
        d.stop()
        kill_vms_of(d.data_dir)
    report("checkpoints, diffs and rewind (client-side, one sandbox of 1 GiB)", rows, args.json)


if __name__ == "__main__":
    main()
