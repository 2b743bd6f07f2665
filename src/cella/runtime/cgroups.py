"""A host cgroup per VM for its CPU share: cgroup v2 where the cpu controller is available,
else cgroup v1's cpu hierarchy; nothing (and a log line) where neither is writable."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

log = logging.getLogger("cella.cgroups")
PERIOD_US = 100_000
# QEMU's main loop and I/O threads get half a CPU on top of the vCPUs
EXTRA_US = PERIOD_US // 2


class CpuLimiter:
    def __init__(self, root: Path = Path("/sys/fs/cgroup")) -> None:
        self.version: int | None = None
        self.base: Path | None = None
        v2 = root / "cgroup.controllers"
        if v2.exists() and "cpu" in v2.read_text().split():
            with contextlib.suppress(OSError):
                (root / "cgroup.subtree_control").write_text("+cpu")
                base = root / "cella"
                base.mkdir(exist_ok=True)
                (base / "cgroup.subtree_control").write_text("+cpu")
                self.version, self.base = 2, base
        if self.base is None:
            for name in ("cpu", "cpu,cpuacct"):
                v1 = root / name
                if (v1 / "cpu.cfs_quota_us").exists():
                    with contextlib.suppress(OSError):
                        base = v1 / "cella"
                        base.mkdir(exist_ok=True)
                        self.version, self.base = 1, base
                        break
        if self.base is None:
            log.warning("no writable cpu cgroup controller: QEMU CPU shares are not limited")

    def apply(self, name: str, pid: int, vcpus: int) -> Path | None:
        """Caps the VM at its vCPUs (plus QEMU's own threads) and weighs it by them."""
        if self.base is None:
            return None
        group = self.base / name
        try:
            group.mkdir(exist_ok=True)
            quota = vcpus * PERIOD_US + EXTRA_US
            if self.version == 2:
                (group / "cpu.max").write_text(f"{quota} {PERIOD_US}")
                (group / "cpu.weight").write_text(str(min(10000, 100 * vcpus)))
            else:
                (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                (group / "cpu.cfs_quota_us").write_text(str(quota))
                (group / "cpu.shares").write_text(str(1024 * vcpus))
            (group / "cgroup.procs").write_text(str(pid))
        except OSError as exc:
            log.warning("cannot limit the CPU of %s: %s", name, exc)
            return None
        return group

    def group(self, name: str) -> Path | None:
        return self.base / name if self.base is not None else None

    def remove(self, name: str) -> None:
        if self.base is not None:
            with contextlib.suppress(OSError):
                (self.base / name).rmdir()

    def cpu_seconds(self, name: str) -> float | None:
        """CPU time used by the VM's group, if the host accounts it."""
        if self.base is None:
            return None
        group = self.base / name
        with contextlib.suppress(OSError, ValueError):
            if self.version == 2:
                for line in (group / "cpu.stat").read_text().splitlines():
                    if line.startswith("usage_usec"):
                        return int(line.split()[1]) / 1e6
            else:
                acct = group.parent.parent / "cpuacct" / "cella" / group.name / "cpuacct.usage"
                if acct.exists():
                    return int(acct.read_text()) / 1e9
        return None
