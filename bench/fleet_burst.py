"""Bursts through the fleet gateway next to the same bursts straight to its node: what the
gateway adds when a dataset's worth of sandboxes is asked for at once.

    .venv/bin/python -m bench.fleet_burst [--bursts 10,30] [--rounds 2] [--json]

Runs inside a loopback-only network namespace (it re-executes itself under `unshare -n`).
A Ray head, one `cella_node` node (`n1`) and a gateway on this host; each round sends a burst
of N simultaneous creates, each followed by `true`, through the gateway and then straight to
n1's daemon (alternating which goes first), through the public async SDK. Both paths end on
the same node daemon and the same 2 cores, so the difference is the gateway's placement,
relay and records, not another host's speed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._stats import pct, report
from bench.fleet import loopback_only
from cella import AsyncClient, Client
from tests.daemon import Daemon, kill_vms_of
from tests.raycluster import LocalCluster, quiet_ray_env

SHAPE = {"vcpus": 1, "memory_mib": 256}


async def one_burst(url: str, key: str, n: int) -> dict[str, float]:
    """N creates at once, each then runs `true`; then all deleted."""
    created: list[float] = []
    answered: list[float] = []
    failed: list[str] = []
    async with AsyncClient(url, key, timeout=600) as c:

        async def one() -> Any:
            t = time.perf_counter()
            try:
                sb = await c.create(**SHAPE)
                created.append(time.perf_counter() - t)
                r = await sb.exec(["true"], timeout=300)
                assert r.exit_code == 0
                answered.append(time.perf_counter() - t)
                return sb
            except Exception as exc:
                failed.append(repr(exc)[:200])
                return None

        t0 = time.perf_counter()
        made = [sb for sb in await asyncio.gather(*(one() for _ in range(n))) if sb]
        wall = time.perf_counter() - t0
        await asyncio.gather(*(sb.delete() for sb in made))
    if failed:
        print(f"burst of {n} via {url}: {len(failed)} failed, e.g. {failed[0]}")
    return {
        "answered": len(answered),
        "create p50 (ms)": round(1000 * statistics.median(created), 1) if created else 0.0,
        "create p99 (ms)": round(1000 * pct(created, 99), 1) if created else 0.0,
        "create + first exec p50 (ms)": (
            round(1000 * statistics.median(answered), 1) if answered else 0.0
        ),
        "all answered (ms)": round(1000 * wall, 1),
    }


def merge(rounds: list[dict[str, float]]) -> dict[str, float]:
    """The median of each figure over the rounds (`answered`: the fewest)."""
    keys = rounds[0].keys()
    return {
        k: min(r[k] for r in rounds) if k == "answered" else statistics.median(r[k] for r in rounds)
        for k in keys
    }


def measure(bursts: list[int], rounds: int) -> dict[str, dict[str, Any]]:
    quiet_ray_env()
    root = Path(tempfile.mkdtemp(prefix="cella-bench-fleet-burst-"))
    cluster = LocalCluster()
    gateway = None
    largest = max(bursts)
    node = {
        "pool_size": "0",
        "max_host_memory_mib": str((largest + 4) * SHAPE["memory_mib"]),
        "max_sandboxes_per_tenant": str(largest + 4),
    }
    try:
        cluster.add("n1", **node)
        gateway = Daemon(
            root / "gateway",
            args=["--ray", cluster.address, "--node-root", str(root / "nodes")],
            max_sandboxes_per_tenant=str(largest + 4),
        ).start(timeout=240)
        with Client(gateway.url, gateway.admin_key) as gw:
            while sum(n.healthy for n in gw.fleet().nodes) < 1:
                time.sleep(0.2)
            n1_url = str(gw.fleet().nodes[0].url)
            gw.create(**SHAPE).delete()  # the template is on n1, its warm snapshot made
        n1_key = (root / "nodes" / "n1" / "admin.key").read_text().strip()
        os.environ["SSL_CERT_FILE"] = str(root / "nodes" / "n1" / "tls" / "node.crt")
        paths = {
            "through the gateway": (gateway.url, gateway.admin_key),
            "straight": (n1_url, n1_key),
        }
        rows: dict[str, dict[str, Any]] = {}
        for n in bursts:
            seen: dict[str, list[dict[str, float]]] = {name: [] for name in paths}
            for i in range(rounds):
                order = list(paths) if i % 2 == 0 else list(reversed(paths))
                for name in order:
                    seen[name].append(asyncio.run(one_burst(*paths[name], n)))
            gw_row, direct_row = merge(seen["through the gateway"]), merge(seen["straight"])
            rows[f"burst {n}: straight to the node"] = direct_row
            rows[f"burst {n}: through the gateway"] = {
                **gw_row,
                "all answered ratio": round(
                    gw_row["all answered (ms)"] / direct_row["all answered (ms)"], 2
                ),
            }
        return rows
    finally:
        if gateway is not None:
            gateway.stop()
        cluster.shutdown()
        time.sleep(0.5)
        for node_dir in (root / "nodes").iterdir() if (root / "nodes").exists() else []:
            kill_vms_of(node_dir)
        subprocess.run(["rm", "-rf", str(root)], check=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bursts", default="10,30", help="sizes of the simultaneous bursts")
    parser.add_argument("--rounds", type=int, default=2, help="bursts of each size each way")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if not loopback_only():
        inner = f"ip link set lo up && exec {sys.executable} -m bench.fleet_burst " + " ".join(
            sys.argv[1:]
        )
        os.execvp("unshare", ["unshare", "--net", "--", "sh", "-c", inner])
    bursts = [int(n) for n in args.bursts.split(",") if n]
    report(
        "fleet: bursts through the gateway and straight to its node",
        measure(bursts, args.rounds),
        args.json,
    )


if __name__ == "__main__":
    main()
