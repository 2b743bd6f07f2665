"""Where an idle sandbox's memory goes: PSS of its QEMU split by mapping.

    .venv/bin/python -m bench.pss [--vms 10] [--settle 3] [--json]

Restores `--vms` VMs from the default template's warm snapshot (as the daemon does), lets
them idle, and reads `/proc/PID/smaps` of each: the guest's RAM (pages shared with the
snapshot's file vs pages the guest wrote since its restore), TCG's translated-code buffer
(the executable anonymous mapping), QEMU's other anonymous memory (heap, device and thread
buffers) and the files it maps (binary, libraries).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from collections import defaultdict
from pathlib import Path

from bench._stats import report
from cella.config import DaemonSettings
from cella.paths import Paths
from cella.runtime.qemu.driver import QemuDriver
from cella.runtime.qemu.jail import jail_ids
from cella.service.warm import Shape, WarmSnapshots

PARTS = (
    "guest RAM, shared with the snapshot file",
    "guest RAM, written since the restore",
    "TCG translated code",
    "QEMU heap and other anonymous memory",
    "QEMU binary and libraries",
)


def breakdown(pid: int, ram_file: Path) -> dict[str, float]:
    """KiB of PSS per part (guest RAM split by clean shared vs private dirty pages)."""
    parts: dict[str, float] = defaultdict(float)
    blocks: list[tuple[str, str, dict[str, int]]] = []  # (path, perms, fields) per mapping
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if not head[0].endswith(":"):  # a mapping: range, perms, offset, device, inode, path
            blocks.append((head[5] if len(head) > 5 else "", head[1], {}))
        elif len(head) >= 2 and head[1].isdigit():  # "Pss: 12 kB" (not "VmFlags: rd wr")
            blocks[-1][2][head[0][:-1]] = int(head[1])
    for name, perms, f in blocks:
        pss = f.get("Pss", 0)
        if name == str(ram_file):
            written = f.get("Private_Dirty", 0) + f.get("Swap", 0)
            parts[PARTS[1]] += written
            parts[PARTS[0]] += max(0, pss - written)
        elif not name or name.startswith("["):
            parts[PARTS[2] if "x" in perms else PARTS[3]] += pss
        else:
            parts[PARTS[4]] += pss
    return parts


async def measure(vms: int, settle: float) -> dict[str, dict[str, float | int | str]]:
    driver = QemuDriver(Paths.default(), jail=jail_ids(DaemonSettings()))
    snap = await WarmSnapshots(driver).ensure(Shape("default", 1, 512))
    work = Path(tempfile.mkdtemp(prefix="cella-pss-", dir=driver.paths.vms))
    started = []
    try:
        for i in range(vms):
            started.append(await driver.restore(snap, work / f"vm{i}"))
        await asyncio.sleep(settle)
        per_vm = [breakdown(vm.pid or 0, snap.ram) for vm in started]
    finally:
        for vm in started:
            await driver.destroy(vm)
        driver.remove_directory(work)
    rows: dict[str, dict[str, float | int | str]] = {}
    totals = sorted(sum(p.values()) for p in per_vm)
    for part in PARTS:
        values = sorted(p[part] for p in per_vm)
        rows[part] = {
            "n": len(values),
            "p50 (MiB)": round(values[len(values) // 2] / 1024, 2),
            "max (MiB)": round(values[-1] / 1024, 2),
        }
    rows["total PSS per VM"] = {
        "n": len(totals),
        "p50 (MiB)": round(totals[len(totals) // 2] / 1024, 2),
        "max (MiB)": round(totals[-1] / 1024, 2),
        "target": "<=20",
    }
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--vms", type=int, default=10)
    parser.add_argument("--settle", type=float, default=3.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    report(
        f"PSS of an idle sandbox's QEMU, by part ({args.vms} VMs from one snapshot)",
        asyncio.run(measure(args.vms, args.settle)),
        args.json,
    )


if __name__ == "__main__":
    main()
