"""Host packages cella needs, installed through apt (idempotent).

This module is standard library only: `scripts/bootstrap` reads the lists with the system's
python3 before any virtualenv exists, installs `FIRST_PACKAGES` at once and the rest in the
background (its pid in `BOOTSTRAP_APT_PID`, which `ensure_host_packages` waits for).
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from cella import errors
from cella._proc import Progress, quiet, run

HOST_PACKAGES = (
    "qemu-system-x86",  # the microVM monitor (and qemu-storage-daemon: disks seen as files)
    "qemu-utils",  # qemu-img: overlays and base images
    "mmdebstrap",  # template root file systems (apt's parallel downloads, one dpkg pass)
    "e2fsprogs",  # mkfs.ext4 -d; debugfs and e2fsck read checkpoints for diffs
    "gcc",  # building the guest agent and kernel
    "libc6-dev",  # static libc for the agent
    "make",  # the rest builds the guest kernel from Debian's source package
    "bc",
    "bison",
    "flex",
    "libelf-dev",
    "libssl-dev",
    "xz-utils",
    "patch",
    "ca-certificates",
    "python3-venv",  # the egress proxy's own environment
    "git",
    "skopeo",  # fetching OCI/Docker images for templates
    "umoci",  # unpacking them (whiteouts, hard links, xattrs, owners)
)


# what a first start needs before the rest: the template's tools, the proxy's virtualenv
FIRST_PACKAGES = ("mmdebstrap", "e2fsprogs", "qemu-utils", "ca-certificates", "python3-venv")
BOOTSTRAP_APT_PID = "CELLA_BOOTSTRAP_APT_PID"


def missing_packages(packages: tuple[str, ...] = HOST_PACKAGES) -> list[str]:
    missing = []
    for pkg in packages:
        out = subprocess.run(
            ["dpkg-query", "-W", "-f=${db:Status-Status}", pkg],
            capture_output=True,
            text=True,
            check=False,
        ).stdout
        if out.strip() != "installed":
            missing.append(pkg)
    return missing


def ensure_host_packages(
    progress: Progress = quiet, packages: tuple[str, ...] = HOST_PACKAGES
) -> list[str]:
    """Installs whatever of `packages` is missing; returns what was installed."""
    missing = missing_packages(packages)
    if missing and _await_bootstrap(progress):
        missing = missing_packages(packages)  # what bootstrap's apt-get did not install
    if not missing:
        progress("host packages: all present")
        return []
    if os.geteuid() != 0:
        raise errors.PermissionDenied(f"installing {' '.join(missing)} needs root")
    progress(f"installing host packages: {' '.join(missing)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    run(["apt-get", "update", "-q"], env=env, progress=lambda line: progress(f"  {line}"))
    run(
        ["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing],
        env=env,
        progress=lambda line: (
            progress(f"  {line}") if line.startswith(("Setting up", "Get:")) else None
        ),
    )
    return missing


def _await_bootstrap(progress: Progress) -> bool:
    """Waits for the apt-get that `scripts/bootstrap` started in the background, if it
    still runs (apt allows one at a time; what it installs need not be installed again);
    whether there was one."""
    pid = os.environ.get(BOOTSTRAP_APT_PID, "")
    if not pid.isdigit():
        return False
    stat = Path(f"/proc/{pid}/stat")
    try:
        if b"bootstrap" not in Path(f"/proc/{pid}/cmdline").read_bytes():
            return False  # gone, its pid another process's now
    except OSError:
        return False
    told = False
    while True:
        try:  # its state is the field after the parenthesised name; Z: exited, not reaped
            state = stat.read_text().rpartition(")")[2].split()[0]
        except (OSError, IndexError):
            return True
        if state in ("Z", "X"):
            return True
        if not told:
            progress("waiting for the host packages scripts/bootstrap is installing")
            told = True
        time.sleep(0.5)
