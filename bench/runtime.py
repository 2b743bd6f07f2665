"""Runtime-level figures: cold boot to agent-ready; exec round trip of `true` and of a
static binary.

.venv/bin/python -m bench.runtime [--boots 5] [--execs 200] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import tempfile
import time
from pathlib import Path

from bench._stats import report, summary_ms
from cella.config import DaemonSettings
from cella.paths import Paths
from cella.runtime.qemu.driver import QemuDriver
from cella.runtime.qemu.jail import jail_ids


def static_nop() -> bytes:
    """A statically linked program that exits 0 at once (compiled here with gcc)."""
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "nop.c", Path(tmp) / "nop"
        src.write_text("int main(void) { return 0; }\n")
        subprocess.run(["gcc", "-static", "-O2", "-o", str(out), str(src)], check=True)
        return out.read_bytes()


async def measure(boots: int, execs: int) -> dict[str, dict[str, object]]:
    driver = QemuDriver(Paths.default(), jail=jail_ids(DaemonSettings()))  # as the daemon runs it
    choice = await driver.prepare()
    boot_times = []
    for _ in range(boots):
        vm = await driver.boot()
        assert vm.boot_seconds is not None
        boot_times.append(vm.boot_seconds)
        await driver.destroy(vm)
    vm = await driver.boot()
    try:
        # a static binary that does nothing beside `true` (dynamically linked): the agent's
        # channel and process creation told apart from the dynamic loader's work
        await vm.agent.write_file("/usr/local/bin/nop-static", static_nop(), mode=0o755)
        runs: dict[str, list[float]] = {"true": [], "/usr/local/bin/nop-static": []}
        for program in runs:
            for _ in range(20):  # warm the guest's page cache and TCG translations
                await vm.agent.exec([program])
        for _ in range(execs):
            for program, times in runs.items():  # alternating: the same host load for both
                t = time.perf_counter()
                await vm.agent.exec([program])
                times.append(time.perf_counter() - t)
        rtt = runs["true"]
        ping = []
        for _ in range(execs):
            t = time.perf_counter()
            await vm.agent.ping()
            ping.append(time.perf_counter() - t)
    finally:
        await driver.destroy(vm)
    return {
        f"cold boot to agent ready [{choice.accel}]": {
            **summary_ms(boot_times),
            "target": "p50 <= 1000",
        },
        "exec round trip of `true`": {**summary_ms(rtt), "target": "p50 <= 2, p99 <= 4"},
        "exec round trip of a static binary": summary_ms(runs["/usr/local/bin/nop-static"]),
        "agent ping round trip": summary_ms(ping),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--boots", type=int, default=5)
    parser.add_argument("--execs", type=int, default=200)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = asyncio.run(measure(args.boots, args.execs))
    report("cella runtime", rows, args.json)


if __name__ == "__main__":
    main()
