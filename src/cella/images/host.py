"""Host packages cella needs, installed through apt (idempotent)."""

from __future__ import annotations

import os
import subprocess

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


def ensure_host_packages(progress: Progress = quiet) -> list[str]:
    """Installs whatever is missing; returns what was installed."""
    missing = missing_packages()
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
