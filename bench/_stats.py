"""Percentiles and table printing shared by the benchmarks."""

from __future__ import annotations

import json
import statistics
import sys
from typing import Any

from rich.console import Console
from rich.table import Table


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(p / 100 * (len(ordered) - 1))))
    return ordered[k]


def summary_ms(values: list[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values]
    return {
        "n": len(ms),
        "min": round(min(ms), 2),
        "p50": round(statistics.median(ms), 2),
        "p99": round(pct(ms, 99), 2),
        "max": round(max(ms), 2),
    }


def report(title: str, rows: dict[str, dict[str, Any]], as_json: bool) -> None:
    if as_json:
        sys.stdout.write(json.dumps({"title": title, "rows": rows}, indent=2) + "\n")
        return
    known = ["n", "min", "p50", "p99", "max", "target", "ratio"]
    seen = list(dict.fromkeys(k for r in rows.values() for k in r))  # others: as first seen
    columns = sorted(seen, key=lambda c: known.index(c) if c in known else len(known))
    timed = ("min", "p50", "p99", "max")
    table = Table(*["measure", *[f"{c} (ms)" if c in timed else c for c in columns]], title=title)
    for name, row in rows.items():
        table.add_row(name, *[str(row.get(c, "")) for c in columns])
    Console().print(table)
