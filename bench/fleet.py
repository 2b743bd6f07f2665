"""A fleet on a real Ray cluster on this host: what the gateway costs, how evals scale with
nodes, how fast snapshots move between nodes, and what moving a running sandbox costs.

    .venv/bin/python -m bench.fleet [--calls 40] [--tasks 24] [--json] [--moves-only]
                                    [--compare /tmp/base/src]

Runs inside a loopback-only network namespace (it re-executes itself under `unshare -n`).
A head and up to three `cella_node` nodes (`tests/raycluster.py`), one gateway. Through the
gateway and straight to the same node daemon, interleaved: create (restored from the warm
snapshot) and exec of `true`. Then one eval of `--tasks` tasks with 1, 2 and 3 nodes of the
same cluster (nodes added between runs; each run twice: first a new node pulls the snapshot,
then it is cached), and a 512 MiB snapshot (200 MB of it random) pulled by one node daemon
from another. Every node shares this host's 2 cores, so the eval figure shows that tasks
spread over nodes and what the gateway and Ray add, not the scaling of separate hosts.

Moves: a running sandbox whose guest wrote 10 or 200 MiB into its memory (`/dev/shm`) and
as much to its disk (past its page cache), moved n1 -> n2 -> n1, each move as the gateway
reports it: the pre-copy (its time, the guest running, and what it sent), the guest's pause
and what the freeze shipped. `--compare SRC` (with `--moves-only`) first runs the same moves
on a cluster and gateway from another checkout's `src` (e.g. `git worktree add /tmp/base
main`), in a process of its own, and prints each figure beside this checkout's with their
ratio: the host is shared, so only figures of one run are compared.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx2

from bench._stats import report, summary_ms
from cella import Client
from cella.eval import Task, run_eval
from cella.fleet.tls import trusting
from tests.daemon import Daemon, kill_vms_of
from tests.raycluster import LocalCluster, quiet_ray_env

MEMORY = 256  # MiB per sandbox
NODE = {"pool_size": "0", "max_host_memory_mib": "4096"}
READ_DISK = "dd if=/root/disk bs=1M iflag=direct status=none | md5sum"


def loopback_only() -> bool:
    return [name for _, name in socket.if_nameindex()] == ["lo"]


def timed(fn: Any) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def overhead(gateway: Client, direct: Client, calls: int) -> dict[str, dict[str, Any]]:
    """Create and exec through the gateway and straight to n1's daemon, interleaved."""
    samples: dict[str, list[float]] = {
        k: [] for k in ("gw create", "direct create", "gw exec", "direct exec")
    }
    for _ in range(calls // 4):
        for name, c in (("gw", gateway), ("direct", direct)):
            t = time.perf_counter()
            made = c.create(memory_mib=MEMORY)
            samples[f"{name} create"].append(time.perf_counter() - t)
            made.delete()
    gw_sb = gateway.create(memory_mib=MEMORY)
    direct_sb = direct.get(gw_sb.id)  # the same sandbox, on n1, reached both ways
    for _ in range(calls):
        samples["gw exec"].append(timed(lambda: gw_sb.exec(["true"])))
        samples["direct exec"].append(timed(lambda: direct_sb.exec(["true"])))
    gw_sb.delete()
    rows = {}
    for what in ("create", "exec"):
        gw, straight = summary_ms(samples[f"gw {what}"]), summary_ms(samples[f"direct {what}"])
        rows[f"{what}: straight to the node"] = straight
        rows[f"{what}: through the gateway"] = {
            **gw,
            "overhead p50 ms": round(gw["p50"] - straight["p50"], 2),
            "ratio": round(gw["p50"] / straight["p50"], 2),
        }
    return rows


def eval_rate(
    gateway_url: str, key: str, snapshot: str, tasks: int, address: str, out: Path
) -> dict[str, Any]:
    # imported here: Ray reads its token mode when imported, after `quiet_ray_env` set it
    from cella.fleet.evals import RayRunner

    work = [Task(id=f"t{i}", check="true", workdir="/root") for i in range(tasks)]
    t = time.perf_counter()
    runner = RayRunner(address)
    results = run_eval(
        work, snapshot, parallel=6, out_dir=out, url=gateway_url, api_key=key, runner=runner
    )
    seconds = time.perf_counter() - t
    assert all(r.passed for r in results), [r.error for r in results if not r.passed]
    return {
        "tasks": tasks,
        "seconds": round(seconds, 1),
        "tasks/min": round(tasks / seconds * 60, 1),
        "nodes used": len({r.node for r in results}),
    }


def shipping(fleet_root: Path, urls: dict[str, str], snapshot_id: str) -> dict[str, Any]:
    """n2 pulls the snapshot from n1 (node to node), files checked against the manifest."""
    key = {n: (fleet_root / n / "admin.key").read_text().strip() for n in ("n1", "n2")}
    cert = {n: (fleet_root / n / "tls" / "node.crt").read_text() for n in ("n1", "n2")}
    manifest = httpx2.get(
        f"{urls['n1']}/v1/snapshots/{snapshot_id}/export",
        headers={"authorization": f"Bearer {key['n1']}"},
        verify=trusting(cert["n1"]),
    ).json()["manifest"]
    size = sum(manifest["bytes"].values())
    t = time.perf_counter()
    answer = httpx2.post(
        f"{urls['n2']}/v1/snapshots/import",
        headers={"authorization": f"Bearer {key['n2']}"},
        json={
            "source_url": urls["n1"],
            "source_key": key["n1"],
            "source_ca": cert["n1"],
            "snapshot_id": snapshot_id,
        },
        timeout=600,
        verify=trusting(cert["n2"]),
    )
    seconds = time.perf_counter() - t
    assert answer.status_code == 201, answer.text
    return {
        "MiB": round(size / (1 << 20), 1),
        "seconds": round(seconds, 2),
        "MB/s": round(size / seconds / 1e6, 1),
    }


def moves(gw: Client, runs: int = 2) -> dict[str, dict[str, Any]]:
    """A running sandbox on n1, its guest having dirtied `mib` of memory and written as much
    to its disk, moved to n2 and back (`runs` moves each way round), as the gateway reports
    each move."""
    rows: dict[str, dict[str, Any]] = {}
    for mib in (10, 200):
        sb = gw.get(
            gw.request(
                "POST", "/v1/sandboxes", json={"memory_mib": 512}, headers={"X-Cella-Node": "n1"}
            ).json()["id"]
        )
        try:
            sb.exec(f"head -c {mib << 20} /dev/urandom > /dev/shm/fill")
            sb.exec(f"dd if=/dev/urandom of=/root/disk bs=1M count={mib} oflag=direct status=none")
            # read past its page cache too: the guest's RAM holds the `mib` of /dev/shm only
            digest = sb.exec(READ_DISK).stdout
            pauses, transfers, shipped, ahead_ms, ahead = [], [], [], [], []
            for i in range(runs):
                report = sb.move("n2" if i % 2 == 0 else "n1")
                assert report.ok and report.paused_ms and report.bytes, report
                pauses.append(report.paused_ms)
                transfers.append(report.transfer_ms or 0.0)
                shipped.append(report.bytes)
                # a checkout before the pre-copy reports none
                ahead_ms.append(getattr(report, "precopy_ms", None) or 0.0)
                ahead.append(getattr(report, "precopy_bytes", None) or 0)
                assert sb.exec("wc -c < /dev/shm/fill").stdout.strip() == str(mib << 20).encode()
                assert sb.exec(READ_DISK).stdout == digest
            rows[f"{mib} MiB dirtied + {mib} MiB on disk, running, 512 MiB VM"] = {
                "moves": runs,
                "pre-copy ms p50": round(statistics.median(ahead_ms), 1),
                "MiB before freeze": round(statistics.median(ahead) / (1 << 20), 1),
                "pause ms p50": round(statistics.median(pauses), 1),
                "pause ms max": round(max(pauses), 1),
                "transfer ms p50": round(statistics.median(transfers), 1),
                "MiB shipped frozen": round(statistics.median(shipped) / (1 << 20), 1),
            }
        finally:
            sb.delete()
    return rows


def compared(base: dict[str, dict[str, Any]], this: dict[str, dict[str, Any]]) -> Tables:
    """Each figure of this checkout beside the other's, with this/base."""
    rows: dict[str, dict[str, Any]] = {}
    for name, figures in this.items():
        for figure, value in figures.items():
            if figure == "moves":
                continue
            b = base.get(name, {}).get(figure)
            rows[f"{name}: {figure}"] = {
                "base": "" if b is None else b,
                "this": value,
                "this/base": round(value / b, 3) if b else "",
            }
    return {"moving a running sandbox, n1 <-> n2, this checkout against base": rows}


Tables = dict[str, dict[str, dict[str, Any]]]


def measure(calls: int, tasks: int, moves_only: bool = False) -> Tables:
    quiet_ray_env()
    root = Path(tempfile.mkdtemp(prefix="cella-bench-fleet-"))
    cluster = LocalCluster()
    gateway = None
    try:
        cluster.add("n1", **NODE)
        if moves_only:
            cluster.add("n2", **NODE)
        gateway = Daemon(
            root / "gateway", args=["--ray", cluster.address, "--node-root", str(root / "nodes")]
        ).start(timeout=240)
        with Client(gateway.url, gateway.admin_key) as gw:
            if moves_only:
                while sum(n.healthy for n in gw.fleet().nodes) < 2:
                    time.sleep(0.2)
                return {"moving a running sandbox, n1 <-> n2": moves(gw)}
            urls = {n.name: str(n.url) for n in gw.fleet().nodes}
            n1_key = (root / "nodes" / "n1" / "admin.key").read_text().strip()
            # the direct client trusts the node's own certificate (node daemons speak TLS)
            os.environ["SSL_CERT_FILE"] = str(root / "nodes" / "n1" / "tls" / "node.crt")
            with Client(urls["n1"], n1_key) as direct:
                tables: Tables = {"the gateway's cost (ms)": overhead(gw, direct, calls)}
            evals = tables["eval throughput, nodes of one cluster"] = {}
            base = gw.create(memory_mib=MEMORY)
            snap = base.snapshot("bench")
            base.delete()
            big = gw.create(memory_mib=512)
            big.exec("head -c 200000000 /dev/urandom > /dev/shm/fill")  # RAM worth moving
            big_snap = big.snapshot("ship")
            big.delete()
            for count in (1, 2, 3):
                if count > 1:
                    cluster.add(f"n{count}", **NODE)
                    while sum(n.healthy for n in gw.fleet().nodes) < count:
                        time.sleep(0.2)
                for run in ("first run", "second run"):
                    evals[f"{count} node(s), {run}"] = eval_rate(
                        gateway.url,
                        gateway.admin_key,
                        snap.id,
                        tasks,
                        cluster.address,
                        root / f"eval-{count}-{run[:5]}",
                    )
            urls = {n.name: str(n.url) for n in gw.fleet().nodes}
            tables["snapshot shipping"] = {
                "n1 -> n2 (pull, verify)": shipping(root / "nodes", urls, big_snap.id)
            }
            tables["moving a running sandbox, n1 <-> n2"] = moves(gw)
        return tables
    finally:
        if gateway is not None:
            gateway.stop()
        cluster.shutdown()
        time.sleep(0.5)
        for node in (root / "nodes").iterdir() if (root / "nodes").exists() else []:
            kill_vms_of(node)
        subprocess.run(["rm", "-rf", str(root)], check=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=40, help="creates and execs each way")
    parser.add_argument("--tasks", type=int, default=24, help="eval tasks per run")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--moves-only", action="store_true", help="only the sandbox moves")
    parser.add_argument("--compare", help="another checkout's src: its moves measured first")
    parser.add_argument("--rows-to", help=argparse.SUPPRESS)  # the moves' rows, as JSON
    args = parser.parse_args()
    if not loopback_only():
        inner = f"ip link set lo up && exec {sys.executable} -m bench.fleet " + " ".join(
            sys.argv[1:]
        )
        os.execvp("unshare", ["unshare", "--net", "--", "sh", "-c", inner])
    if args.compare:  # the other checkout's cluster and gateway, in a process of their own
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            env = {**os.environ, "PYTHONPATH": args.compare}
            argv = [sys.executable, "-m", "bench.fleet", "--moves-only", "--rows-to", out.name]
            subprocess.run(argv, env=env, check=True)
            base = json.loads(Path(out.name).read_text())
        this = measure(args.calls, args.tasks, moves_only=True)
        moved = this["moving a running sandbox, n1 <-> n2"]
        for title, rows in compared(base, moved).items():
            report(f"fleet: {title}", rows, args.json)
        return
    tables = measure(args.calls, args.tasks, args.moves_only)
    if args.rows_to:
        Path(args.rows_to).write_text(json.dumps(tables["moving a running sandbox, n1 <-> n2"]))
    for title, rows in tables.items():
        report(f"fleet: {title}", rows, args.json)


if __name__ == "__main__":
    main()
