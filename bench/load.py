"""Load through the API: N concurrent creates, then M concurrent execs spread across the
sandboxes; errors counted, latency percentiles, and a leak check after deleting them all.

    .venv/bin/python -m bench.load [--creates 50] [--execs 500] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._stats import report, summary_ms
from cella import AsyncClient
from cella.runtime.qemu.vm import qemu_cmdline
from tests.daemon import Daemon, kill_vms_of
from tests.vms import qemu_pids


async def run_load(url: str, key: str, creates: int, execs: int) -> dict[str, Any]:
    """Returns latencies (seconds) and errors of each phase; deletes what it made."""
    async with AsyncClient(url, key, timeout=600) as client:
        create_times: list[float] = []
        errors: list[str] = []

        async def create() -> Any:
            t = time.perf_counter()
            try:
                sb = await client.create(memory_mib=256)
            except Exception as exc:
                errors.append(f"create: {exc!r}")
                return None
            create_times.append(time.perf_counter() - t)
            return sb

        made = [sb for sb in await asyncio.gather(*(create() for _ in range(creates))) if sb]
        exec_times: list[float] = []

        async def run(i: int) -> None:
            sb = made[i % len(made)]
            t = time.perf_counter()
            try:
                r = await sb.exec(["echo", str(i)], timeout=120)
                if r.stdout != f"{i}\n".encode() or r.exit_code != 0:
                    errors.append(f"exec {i}: {r.exit_code} {r.stdout!r}")
            except Exception as exc:
                errors.append(f"exec {i}: {exc!r}")
                return
            exec_times.append(time.perf_counter() - t)

        if made:
            await asyncio.gather(*(run(i) for i in range(execs)))
        delete_errors = await asyncio.gather(*(sb.delete() for sb in made), return_exceptions=True)
        errors += [f"delete: {e!r}" for e in delete_errors if isinstance(e, BaseException)]
        left = await client.list()
    return {
        "created": len(made),
        "create_times": create_times,
        "exec_times": exec_times,
        "errors": errors,
        "sandboxes_left": len(left),
    }


def leaks(data_dir: Path) -> dict[str, int]:
    """What a daemon's data directory still holds after every sandbox was deleted."""
    vms = data_dir / "vms"
    return {
        "qemu": sum(1 for p in qemu_pids() if f"{data_dir}/vms/" in " ".join(qemu_cmdline(p))),
        "vm_dirs": len(list(vms.iterdir())) if vms.exists() else 0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--creates", type=int, default=50)
    parser.add_argument("--execs", type=int, default=500)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    d = Daemon(Path(tempfile.mkdtemp(prefix="cella-load-")) / "d", pool_size="0").start()
    try:
        result = asyncio.run(run_load(d.url, d.admin_key, args.creates, args.execs))
        time.sleep(1)
        left = leaks(d.data_dir)
    finally:
        d.stop()
        kill_vms_of(d.data_dir)
    rows = {
        f"{args.creates} concurrent creates": summary_ms(result["create_times"] or [0.0]),
        f"{args.execs} concurrent execs": summary_ms(result["exec_times"] or [0.0]),
        "errors": {"n": len(result["errors"])},
        "left after deleting all (QEMU, VM dirs)": {"n": left["qemu"] + left["vm_dirs"]},
    }
    report("load through the API (256 MiB sandboxes, restored, no pool)", rows, args.json)


if __name__ == "__main__":
    main()
