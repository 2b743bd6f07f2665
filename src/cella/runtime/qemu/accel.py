"""Choosing the accelerator: KVM only when a guest really boots under it, else TCG.

`/dev/kvm` existing is not enough: a paravirtual nested KVM (`kvm_pvm`) opens fine but a
kernel not built for PVM hangs or dies under it. So the probe boots the real kernel and
initramfs to a marker within a deadline, and kills QEMU if it does not get there.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import platform
import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Literal

from cella import errors
from cella.images.boot import BootImage
from cella.runtime.contract import AccelChoice
from cella.runtime.qemu.args import QEMU, Accel, VMConfig, host_tsc_khz, qemu_argv

AccelMode = Literal["auto", "kvm", "tcg"]
PROBE_MARKER = b"CELLA-PROBE-OK"
PROBE_DEADLINE = 10.0


def qemu_accel(choice: AccelChoice) -> Accel:
    """QEMU's `-accel` for a choice `choose_accel` made."""
    return "kvm" if choice.accel == "kvm" else "tcg"


def kvm_flavour() -> str | None:
    """The loaded KVM module that backs /dev/kvm (kvm_intel, kvm_amd, kvm_pvm, ...)."""
    for name in ("kvm_intel", "kvm_amd", "kvm_pvm"):
        if Path("/sys/module", name).exists():
            return name
    return "kvm" if Path("/sys/module/kvm").exists() else None


async def probe_kvm(boot: BootImage, deadline: float = PROBE_DEADLINE) -> str | None:
    """Boots the guest under KVM; returns None on success, else why it is unusable."""
    try:
        fd = os.open("/dev/kvm", os.O_RDWR | os.O_CLOEXEC)
        os.close(fd)
    except OSError as exc:
        return f"/dev/kvm is not usable ({exc.strerror})"
    with tempfile.TemporaryDirectory(prefix="cella-probe-") as tmp_s:
        tmp = Path(tmp_s)
        cfg = VMConfig(
            name="cella-kvm-probe",
            vcpus=1,
            memory_mib=256,
            kernel=boot.kernel.vmlinux,
            initrd=boot.initrd,
            disk=None,
            qmp_socket=tmp / "qmp.sock",
            agent_socket=tmp / "agent.sock",
            console_log=tmp / "console.log",
            accel="kvm",
            extra_cmdline=("cella.probe",),
        )
        cfg.console_log.write_bytes(b"")
        proc = await asyncio.create_subprocess_exec(
            *qemu_argv(cfg, host_tsc_khz()),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        start = time.monotonic()
        try:
            while time.monotonic() - start < deadline:
                if PROBE_MARKER in cfg.console_log.read_bytes():
                    return None
                if proc.returncode is not None:
                    assert proc.stderr is not None
                    err = (await proc.stderr.read(2000)).decode(errors="replace").strip()
                    return f"a KVM guest failed to boot: {err or f'QEMU exit {proc.returncode}'}"
                await asyncio.sleep(0.05)
            return f"a KVM guest did not boot within {deadline:.0f} s"
        finally:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
            await proc.wait()


def _cache_key(boot: BootImage) -> str:
    qemu = shutil.which(QEMU)
    qemu_id = f"{qemu}:{os.stat(qemu).st_mtime_ns}" if qemu else "none"
    parts = [boot.kernel.sha256, qemu_id, platform.release(), str(kvm_flavour())]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


async def choose_accel(
    boot: BootImage, mode: AccelMode = "auto", cache_dir: Path | None = None
) -> AccelChoice:
    """Picks KVM or TCG and says why. `mode="kvm"` fails clearly when KVM cannot boot."""
    if mode == "tcg":
        return AccelChoice("tcg", "TCG requested")
    if not Path("/dev/kvm").exists():
        if mode == "kvm":
            raise errors.AccelUnavailable("KVM requested but this host has no /dev/kvm")
        return AccelChoice("tcg", "no /dev/kvm on this host: using TCG software emulation")
    cache = cache_dir / f"accel-{_cache_key(boot)}.json" if cache_dir else None
    if cache is not None and cache.exists():
        cached = AccelChoice(**json.loads(cache.read_text()))
    else:
        problem = await probe_kvm(boot)
        flavour = kvm_flavour()
        if problem is None:
            cached = AccelChoice("kvm", f"a guest booted under KVM ({flavour})")
        else:
            note = " (kvm_pvm is a paravirtual nested KVM: it runs only kernels built for PVM)"
            cached = AccelChoice(
                "tcg",
                f"{problem}{note if flavour == 'kvm_pvm' else ''}: using TCG software emulation",
            )
        if cache is not None:
            cache.write_text(json.dumps(asdict(cached)))
    if mode == "kvm" and cached.accel != "kvm":
        raise errors.AccelUnavailable(f"KVM requested but unusable: {cached.reason}")
    return cached
