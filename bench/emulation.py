"""What emulation costs, to tell cella's share of a figure from TCG's: QEMU's own start (CPU
and anonymous memory up to its QMP greeting, waiting for an incoming state) with
`-accel tcg` and with `-accel kvm` (which needs no guest to run, so it can be measured
where KVM cannot boot one); a guest's first command after a restore next to the same
command again (the first one translates the code it runs); and what an idle sandbox's QEMU
spends per second, by thread, from its restore on.

    .venv/bin/python -m bench.emulation [--starts 8] [--creates 4] [--idle 40] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bench._stats import report
from cella import AsyncClient
from cella.paths import Paths
from cella.runtime.qemu.args import QEMU
from cella.runtime.qemu.vm import no_thp_inherited, threads_cpu_seconds, threads_schedstat
from tests.daemon import Daemon, kill_vms_of
from tests.vms import qemu_of

SHAPE = {"vcpus": 1, "memory_mib": 512}


def kvm_usable() -> bool:
    return os.access("/dev/kvm", os.R_OK | os.W_OK)


def anonymous_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Anonymous:"):
            return int(line.split()[1])
    return 0


def qemu_start(accel: str, kernel: Path, initrd: Path) -> tuple[float, int]:
    """CPU seconds and anonymous KiB of a QEMU (the microvm cella runs, with its devices)
    from exec to its QMP greeting, waiting for an incoming state; started as the daemon
    starts it (no transparent huge pages)."""
    no_thp_inherited()
    with tempfile.TemporaryDirectory(prefix="cella-emu-") as tmp:
        d = Path(tmp)
        with open(d / "ram", "wb") as f:
            f.truncate(512 << 20)
        subprocess.run(
            ["qemu-img", "create", "-q", "-f", "qcow2", str(d / "disk.qcow2"), "1G"], check=True
        )
        qmp = d / "qmp"
        cpu = "host" if accel == "kvm" else "qemu64,+arat"
        argv = [
            QEMU, "-machine", "microvm,acpi=on,memory-backend=ram", "-accel", accel,
            "-cpu", cpu, "-smp", "1", "-m", "512M", "-nodefaults", "-no-user-config",
            "-nographic", "-no-reboot", "-kernel", str(kernel), "-initrd", str(initrd),
            "-qmp", f"unix:{qmp},server=on,wait=off",
            "-object", "rng-random,id=rng,filename=/dev/urandom",
            "-device", "virtio-rng-device,rng=rng",
            "-device", "virtio-serial-device,max_ports=2",
            "-chardev", f"socket,id=agent,path={d}/agent,server=on,wait=off",
            "-device", "virtserialport,chardev=agent,name=cella.agent",
            "-object", f"memory-backend-file,id=ram,size=512M,mem-path={d}/ram,share=off",
            "-incoming", "defer",
            "-drive", f"id=root,file={d}/disk.qcow2,format=qcow2,if=none",
            "-device", "virtio-blk-device,drive=root",
        ]  # fmt: skip
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 30
            with socket.socket(socket.AF_UNIX) as s:
                while True:
                    try:
                        s.connect(str(qmp))
                        break
                    except OSError:
                        assert time.monotonic() < deadline and proc.poll() is None, "no QMP"
                        time.sleep(0.0005)
                s.recv(4096)  # the greeting: the machine exists
                return threads_cpu_seconds(proc.pid), anonymous_kib(proc.pid)
        finally:
            proc.kill()
            proc.wait()


async def guest_side(creates: int, idle: float) -> dict[str, float]:
    tmp = Path(tempfile.mkdtemp(prefix="cella-emu-"))
    d = Daemon(tmp / "d", pool_size="0", pool_spares="0")
    d.start()
    out: dict[str, float] = {}
    try:
        async with AsyncClient(d.url, d.admin_key, timeout=300) as c:
            first, again = [], []
            for _ in range(creates):  # serial creates by restore: a new QEMU each
                sb = await c.create(**SHAPE)
                pid = qemu_of(sb.id)
                a = threads_cpu_seconds(pid)
                await sb.exec(["true"])
                b = threads_cpu_seconds(pid)
                await sb.exec(["true"])
                first.append(b - a)
                again.append(threads_cpu_seconds(pid) - b)
                await sb.delete()
            out["QEMU CPU of a restored guest's first `true` p50 (ms)"] = ms(first)
            out["QEMU CPU of the same `true` again p50 (ms)"] = ms(again)
            sb = await c.create(**SHAPE)
            await sb.exec(["true"])
            pid, began = qemu_of(sb.id), time.monotonic()
            window = 5.0
            while time.monotonic() - began < idle:
                cpu0, wake0 = threads_schedstat(pid)
                await asyncio.sleep(window)
                cpu1, wake1 = threads_schedstat(pid)
                at = round(time.monotonic() - began)
                out[f"idle VM, {at - 5}-{at} s after its create: CPU (ms/s)"] = round(
                    (cpu1 - cpu0) * 1000 / window, 1
                )
                out[f"idle VM, {at - 5}-{at} s after its create: wake-ups/s"] = round(
                    (wake1 - wake0) / window
                )
            await sb.delete()
    finally:
        d.stop()
        kill_vms_of(d.data_dir)
    return out


def ms(seconds: list[float]) -> float:
    return round(statistics.median(seconds) * 1000, 1) if seconds else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--starts", type=int, default=8)
    parser.add_argument("--creates", type=int, default=4)
    parser.add_argument("--idle", type=float, default=40.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    paths = Paths.default()
    kernel = paths.images / "kernel" / "vmlinux"
    initrd = sorted(paths.images.glob("initramfs-*.cpio"), key=lambda p: p.stat().st_mtime)[-1]
    rows: dict[str, dict[str, object]] = {}
    for accel in ["tcg", *(["kvm"] if kvm_usable() else [])]:
        runs = [qemu_start(accel, kernel, initrd) for _ in range(args.starts)]
        rows[f"QEMU start to its QMP greeting, -accel {accel}: CPU p50 (ms)"] = {
            "value": ms([cpu for cpu, _ in runs])
        }
        rows[f"QEMU start, -accel {accel}: anonymous memory p50 (MiB)"] = {
            "value": round(statistics.median(kib for _, kib in runs) / 1024, 1)
        }
    for k, v in asyncio.run(guest_side(args.creates, args.idle)).items():
        rows[k] = {"value": v}
    report("what emulation costs (QEMU's own start, a first command, an idle VM)", rows, args.json)


if __name__ == "__main__":
    main()
