"""The LangSmith SDK on cella, next to cella's own SDK, in one run against one daemon:
a round trip of `true` (cella `exec`; LangSmith `run` over its WebSocket and over SSE), and
the throughput of a 100 MiB transfer from a server in the guest through a LangSmith tunnel
and through `cella sandbox port-forward`'s WebSocket.

    .venv/bin/python -m bench.langsmith [--runs 30] [--mib 100] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import tempfile
import time
from pathlib import Path

from langsmith.sandbox import SandboxClient

from bench._stats import report, summary_ms
from cella import Client
from tests.daemon import Daemon, free_port, kill_vms_of

SENDER = (
    "import socket\n"
    "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind(('127.0.0.1', 9000)); s.listen(8)\n"
    "block = b'\\0' * (1 << 20)\n"
    "while True:\n"
    "    c, _ = s.accept(); n = int(c.recv(16))\n"
    "    for _ in range(n): c.sendall(block)\n"
    "    c.close()\n"
)


def timed(fn: object, runs: int) -> list[float]:
    out = []
    for i in range(runs + 3):
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        if i >= 3:  # the first ones warm the guest's translation cache
            out.append(time.perf_counter() - start)
    return out


def pull(port: int, mib: int) -> float:
    """MB/s of `mib` MiB read from the guest sender through a local port."""
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(str(mib).encode().ljust(16))
        got = 0
        while chunk := s.recv(1 << 20):
            got += len(chunk)
    assert got == mib << 20, got
    return round(got / (1 << 20) / (time.perf_counter() - start), 1)


async def forward_pull(url: str, key: str, sandbox_id: str, mib: int) -> float:
    from cella.cli.forward import forward

    local = free_port()
    task = asyncio.create_task(forward(url, key, sandbox_id, "127.0.0.1", local, 9000))
    await asyncio.sleep(0.5)
    try:
        rate = await asyncio.to_thread(pull, local, mib)
        await asyncio.sleep(0.2)  # the connection winds down before the listener goes
        return rate
    finally:
        task.cancel()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--mib", type=int, default=100)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    d = Daemon(Path(tempfile.mkdtemp(prefix="bench-ls-")), pool_size="1").start()
    rows: dict[str, dict[str, object]] = {}
    try:
        with Client(d.url, d.admin_key) as cella:
            sb = cella.create()
            rows["cella SDK exec `true`"] = summary_ms(timed(lambda: sb.exec("true"), args.runs))
            ls = SandboxClient(api_endpoint=f"{d.url}/api/v2/sandboxes", api_key=d.admin_key)
            box = ls.create_sandbox(name="bench")
            ws = timed(lambda: box.run("true"), args.runs)
            rows["LangSmith SDK run `true` (WebSocket)"] = summary_ms(ws)
            os.environ["LANGSMITH_EXPERIMENTAL_FEATURES"] = "sandbox_sse_exec"
            sse = timed(lambda: box.run("true"), args.runs)
            del os.environ["LANGSMITH_EXPERIMENTAL_FEATURES"]
            rows["LangSmith SDK run `true` (SSE)"] = summary_ms(sse)
            base = rows["cella SDK exec `true`"]["p50"]
            for row in rows.values():
                row["ratio"] = round(float(row["p50"]) / float(base), 2)  # type: ignore[arg-type]
            box.write("/tmp/sender.py", SENDER)
            box.run("nohup python3 /tmp/sender.py >/dev/null 2>&1 &")
            time.sleep(1.0)
            with box.tunnel(remote_port=9000, local_port=free_port()) as tunnel:
                rate = pull(tunnel.local_port, args.mib)
            rows[f"LangSmith tunnel, {args.mib} MiB (MB/s)"] = {"n": 1, "p50": rate}
            sandbox_id = box.id or ""
            rate = asyncio.run(forward_pull(d.url, d.admin_key, sandbox_id, args.mib))
            rows[f"cella port-forward, {args.mib} MiB (MB/s)"] = {"n": 1, "p50": rate}
            box.delete()
            sb.delete()
    finally:
        d.stop()
        kill_vms_of(d.data_dir)
    report(
        "LangSmith SDK on cella vs cella's own SDK (TCG; MB/s rows are throughput)", rows, args.json
    )


if __name__ == "__main__":
    main()
