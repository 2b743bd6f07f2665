"""A stock kernel that needs no compiling: Debian's cloud kernel package, for a first start.

cella's own kernel (`images/kernel.py`) takes minutes to compile; Debian's `cloud-amd64`
kernel is a download of seconds and boots the microvm too (its bzImage through the microvm's
firmware), with virtio and the file systems the agent uses as modules. Those modules, with
what they depend on, ride in the initramfs in load order (`images/boot.py`) and the agent
loads them before it mounts the root disk. It serves until the tuned kernel is built
(`images/kernel_builds.py`), then stays for the snapshots made on it.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from cella import errors
from cella._proc import Progress, quiet, run
from cella.paths import Paths

IMAGE_META_PACKAGE = "linux-image-cloud-amd64"  # depends on the suite's newest cloud kernel
# what a sandbox needs before and after its root is mounted: the microvm's devices, the file
# systems of mounts and volumes, and socket diagnostics (which process owns a connection)
MODULES = (
    "virtio_mmio",
    "virtio_blk",
    "virtio_console",
    "virtio-rng",
    "overlay",
    "fuse",
    "loop",
    "binfmt_misc",
    "inet_diag",
    "tcp_diag",
)
MODULE_DIR = "modules"
ORDER = "modules.order"  # the .ko files under MODULE_DIR, each after what it depends on


def stock_dir(paths: Paths) -> Path:
    return paths.images / "kernel-stock"


def ensure_stock_kernel(paths: Paths, progress: Progress = quiet) -> Path:
    """Downloads and unpacks the stock kernel once per package version; returns its dir."""
    dest = stock_dir(paths)
    meta = dest / "kernel.json"
    try:
        package, version = _resolve_image()
    except errors.BuildFailed:
        if meta.exists():
            return dest  # no apt sources to ask: what is here stays
        raise
    if meta.exists() and json.loads(meta.read_text()).get("source") == f"{package} {version}":
        return dest
    paths.ensure()
    progress(f"downloading {package} (a stock kernel to start on)")
    with tempfile.TemporaryDirectory(dir=paths.build_tmp, prefix="stock-kernel-") as tmp_s:
        tmp = Path(tmp_s)
        run(["apt-get", "download", package], cwd=tmp)
        root = tmp / "pkg"
        run(["dpkg-deb", "-x", next(tmp.glob("*.deb")), root])
        vmlinuz = next((root / "boot").glob("vmlinuz-*"))
        release = vmlinuz.name.removeprefix("vmlinuz-")
        stage = tmp / "kernel"
        (stage / MODULE_DIR).mkdir(parents=True)
        shutil.copy2(vmlinuz, stage / "vmlinuz")
        shutil.copy2(root / "boot" / f"config-{release}", stage / "config")
        found = {_name(p): p for p in (root / "lib" / "modules" / release).rglob("*.ko")}
        order = load_order(MODULES, found, _depends)
        for name in order:
            shutil.copy2(found[name], stage / MODULE_DIR / f"{name}.ko")
        (stage / ORDER).write_text("".join(f"{name}.ko\n" for name in order))
        (stage / "kernel.json").write_text(
            json.dumps(
                {
                    "version": release,
                    "source": f"{package} {version}",
                    "sha256": hashlib.sha256((stage / "vmlinuz").read_bytes()).hexdigest(),
                },
                indent=2,
            )
        )
        if dest.exists():
            shutil.rmtree(dest)
        stage.rename(dest)
    progress(f"stock kernel {release} ready")
    return dest


def load_order(
    wanted: tuple[str, ...], found: dict[str, Path], depends: Callable[[Path], list[str]]
) -> list[str]:
    """`wanted` and everything they depend on, each after its dependencies."""
    order: list[str] = []
    visiting: set[str] = set()

    def visit(name: str) -> None:
        if name in order:
            return
        if name not in found:
            raise errors.BuildFailed(f"the stock kernel has no module {name}")
        if name in visiting:
            raise errors.BuildFailed(f"modules depend on each other in a loop at {name}")
        visiting.add(name)
        for dep in depends(found[name]):
            visit(dep)
        order.append(name)

    for name in wanted:
        visit(_norm(name))
    return order


def _depends(ko: Path) -> list[str]:
    out = run(["modinfo", "-F", "depends", ko]).strip()
    return [_norm(d) for d in out.split(",") if d]


def _name(ko: Path) -> str:
    return _norm(ko.name.removesuffix(".ko"))


def _norm(name: str) -> str:
    return name.replace("-", "_")  # the kernel treats both as one


def _resolve_image() -> tuple[str, str]:
    """The cloud kernel image package the meta package points at, and its version."""
    for attempt in range(2):
        out = subprocess.run(
            ["apt-cache", "depends", IMAGE_META_PACKAGE], capture_output=True, text=True
        ).stdout
        if match := re.search(r"Depends: (linux-image-[\w.+-]+)", out):
            policy = subprocess.run(
                ["apt-cache", "policy", match.group(1)], capture_output=True, text=True
            ).stdout
            version = re.search(r"Candidate: (\S+)", policy)
            return match.group(1), version.group(1) if version else "unknown"
        if attempt == 0:
            run(["apt-get", "update", "-q"])
    raise errors.BuildFailed(f"cannot resolve {IMAGE_META_PACKAGE} from the apt sources")
