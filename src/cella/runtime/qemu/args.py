"""The QEMU command line for a cella microVM (pure: no processes, easy to test)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Accel = Literal["kvm", "tcg"]
QEMU = "qemu-system-x86_64"
AGENT_PORT = "cella.agent"


@dataclass(frozen=True, slots=True)
class VMConfig:
    name: str
    vcpus: int
    memory_mib: int
    kernel: Path
    initrd: Path
    disk: Path | None
    qmp_socket: Path
    agent_socket: Path
    console_log: Path
    accel: Accel
    extra_cmdline: tuple[str, ...] = ()
    # guest RAM in a file: shared for a template snapshot, private copy-on-write for restores
    ram_file: Path | None = None
    ram_shared: bool = False
    # wait for an incoming migration instead of booting: "defer" (QMP) or a URI
    incoming: str | None = None
    # do not start the vCPUs (a snapshot helper that only loads and saves state)
    paused: bool = False
    seccomp: bool = True  # QEMU's own system-call filter (SECCOMP)
    # the incoming state holds devices only (`QemuVM.save_devices`), which QEMU writes
    # without the configuration section a full migration stream starts with
    devices_only: bool = False


def host_tsc_khz(cpuinfo: str | None = None) -> int | None:
    """The host's TSC rate in kHz, as /proc/cpuinfo reports it."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    match = re.search(r"^cpu MHz\s*:\s*([\d.]+)", cpuinfo, re.M)
    return round(float(match.group(1)) * 1000) if match else None


APIC_TIMER_HZ = 1_000_000_000  # QEMU's emulated local APIC timer (ticks of QEMU's ns clock)
GUEST_HZ = 250  # CONFIG_HZ of the guest kernel (microvm.config)


def kernel_cmdline(accel: Accel, tsc_khz: int | None, extra: tuple[str, ...] = ()) -> str:
    args = [
        "console=ttyS0",
        "quiet",
        "panic=-1",  # reboot on panic; with -no-reboot QEMU exits and the host sees it
        "cryptomgr.notests",
        "i8042.noaux",
        "i8042.nomux",
        "i8042.nopnp",
        "i8042.dumbkbd",
        "random.trust_cpu=on",
    ]
    if accel == "tcg":
        # TCG models no speculation, so mitigations only cost; fixed mappings let translated
        # code be reused across processes (exec is ~3x faster); the guest is one tenant's, so
        # zeroing every allocation buys nothing against a neighbour. KVM keeps all of them.
        args += ["tsc=reliable", "norandmaps", "mitigations=off", "init_on_alloc=0"]
        # a one-vCPU kernel rewrites every LOCK prefix in its text at boot (UP patching):
        # under emulation a large share of a cold boot, for no gain worth it afterwards
        args.append("noreplace-smp")
        # without it a fraction of TCG boots hang after PIT calibration fails
        if tsc_khz:
            args.append(f"tsc_early_khz={tsc_khz}")
        # QEMU's APIC timer runs at 1 GHz and TCG has no TSC deadline mode: telling the
        # guest its period (a parameter cella's kernel patch adds) skips a 100 ms calibration
        args.append(f"lapic_timer_period={APIC_TIMER_HZ // GUEST_HZ}")
    return " ".join([*args, *extra])


# QEMU's own seccomp filter: no obsolete system calls, no setuid/setgid and the like, no
# fork or exec (files reach it as descriptors), no scheduler or resource changes
SECCOMP = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"


def qemu_argv(cfg: VMConfig, tsc_khz: int | None = None) -> list[str]:
    cpu = "host" if cfg.accel == "kvm" else "qemu64,+arat"
    # RAM is always the backend "ram", file or not: a booted VM's RAM migrates to a
    # snapshot helper whose RAM is a file, and migration matches RAM blocks by name
    machine = "microvm,acpi=on,memory-backend=ram"
    argv = [
        QEMU,
        "-name",
        cfg.name,
        "-machine",
        machine,
        "-accel",
        cfg.accel,
        "-cpu",
        cpu,
        "-smp",
        str(cfg.vcpus),
        "-m",
        f"{cfg.memory_mib}M",
        "-nodefaults",
        "-no-user-config",
        "-nographic",
        "-no-reboot",
        "-kernel",
        str(cfg.kernel),
        "-initrd",
        str(cfg.initrd),
        "-append",
        kernel_cmdline(cfg.accel, tsc_khz, cfg.extra_cmdline),
        "-chardev",
        # appended to, so the daemon can cut it down (`QemuVM.trim_console`) under QEMU
        f"file,id=console,path={cfg.console_log},append=on",
        "-serial",
        "chardev:console",
        "-qmp",
        f"unix:{cfg.qmp_socket},server=on,wait=off",
        "-object",
        "rng-random,id=rng,filename=/dev/urandom",
        "-device",
        "virtio-rng-device,rng=rng",
        "-device",
        "virtio-serial-device,max_ports=2",
        "-chardev",
        f"socket,id=agent,path={cfg.agent_socket},server=on,wait=off",
        "-device",
        f"virtserialport,chardev=agent,name={AGENT_PORT}",
        # no NIC: the guest's connections travel as streams over the agent channel
    ]
    if cfg.seccomp:
        argv += ["-sandbox", SECCOMP]
    if cfg.ram_file is not None:
        share = "on" if cfg.ram_shared else "off"
        argv += [
            "-object",
            f"memory-backend-file,id=ram,size={cfg.memory_mib}M,"
            f"mem-path={cfg.ram_file},share={share}",
        ]
    else:
        argv += ["-object", f"memory-backend-ram,id=ram,size={cfg.memory_mib}M"]
    if cfg.incoming is not None:
        argv += ["-incoming", cfg.incoming]
        if cfg.devices_only:
            argv += ["-global", "migration.send-configuration=off"]
    if cfg.paused:
        argv.append("-S")
    if cfg.disk is not None:
        argv += [
            "-drive",
            f"id=root,file={cfg.disk},format=qcow2,if=none,discard=unmap,detect-zeroes=unmap",
            "-device",
            "virtio-blk-device,drive=root",
        ]
    return argv
