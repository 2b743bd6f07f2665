"""The guest kernel: Debian's linux-image-cloud-amd64, unpacked to a bootable ELF.

Booting the uncompressed `vmlinux` through PVH on `-M microvm` skips the in-guest LZ4
decompression, which is slow under TCG. The virtio drivers are modules in this kernel, so the
few we need (and what they depend on) are kept next to it for the initramfs.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cella import errors
from cella._proc import Progress, quiet, run
from cella.paths import Paths

META_PACKAGE = "linux-image-cloud-amd64"
MODULES_TAR = "modules.tar"  # the package's whole /lib/modules/VERSION, for templates
LZ4_LEGACY_MAGIC = bytes([0x02, 0x21, 0x4C, 0x18])
# Loaded in this order by the initramfs (dependencies are added in front automatically).
WANTED_MODULES = (
    "virtio_mmio",
    "virtio_blk",
    "virtio_console",
    "virtio_net",
    "virtio_rng",
    "vmw_vsock_virtio_transport",
)


@dataclass(frozen=True, slots=True)
class Kernel:
    version: str
    vmlinux: Path
    modules: list[Path]  # in load order
    sha256: str

    @classmethod
    def load(cls, paths: Paths) -> Kernel:
        meta = paths.kernel / "kernel.json"
        if not meta.exists():
            raise errors.ImageMissing("no guest kernel yet: run `cella setup`")
        data = json.loads(meta.read_text())
        return cls(
            version=data["version"],
            vmlinux=paths.kernel / "vmlinux",
            modules=[paths.kernel / "modules" / m for m in data["modules"]],
            sha256=data["sha256"],
        )


def ensure_kernel(paths: Paths, progress: Progress = quiet) -> Kernel:
    """Downloads and unpacks the kernel once; later calls return the cached one."""
    try:
        return Kernel.load(paths)
    except errors.ImageMissing:
        pass
    paths.ensure()
    with tempfile.TemporaryDirectory(dir=paths.build_tmp, prefix="kernel-") as tmp_s:
        tmp = Path(tmp_s)
        root = _unpack_package(_resolve_package(), tmp, progress)
        vmlinuz = next((root / "boot").glob("vmlinuz-*"))
        version = vmlinuz.name.removeprefix("vmlinuz-")
        stage = tmp / "kernel"
        (stage / "modules").mkdir(parents=True)
        progress("extracting the uncompressed kernel (vmlinux)")
        extract_vmlinux(vmlinuz, stage / "vmlinux")
        progress("resolving virtio modules")
        modules = _copy_modules(root, version, stage / "modules")
        _save_tree(root, version, stage / MODULES_TAR)
        digest = hashlib.sha256((stage / "vmlinux").read_bytes()).hexdigest()
        (stage / "kernel.json").write_text(
            json.dumps({"version": version, "modules": modules, "sha256": digest}, indent=2)
        )
        # swap in the finished directory whole: a failed run leaves nothing half-written
        if paths.kernel.exists():
            shutil.rmtree(paths.kernel)
        stage.rename(paths.kernel)
    progress(f"guest kernel {version} ready")
    return Kernel.load(paths)


def install_modules(paths: Paths, rootfs: Path, progress: Progress = quiet) -> str:
    """Puts the guest kernel's whole module tree (and its index) into a root file system,
    for templates whose programs load modules (Docker: overlay, bridge, netfilter...); the
    root must have kmod, whose depmod indexes them.
    Returns the kernel version."""
    kernel = Kernel.load(paths)
    tree = paths.kernel / MODULES_TAR
    if not tree.exists():  # a kernel cached before the tree was kept: fetch it once more
        with tempfile.TemporaryDirectory(dir=paths.build_tmp, prefix="modules-") as tmp_s:
            root = _unpack_package(f"linux-image-{kernel.version}", Path(tmp_s), progress)
            _save_tree(root, kernel.version, tree)
    progress(f"adding the modules of kernel {kernel.version}")
    (rootfs / "lib" / "modules").mkdir(parents=True, exist_ok=True)
    with tarfile.open(tree) as tar:
        tar.extractall(rootfs / "lib" / "modules", filter="tar")
    run(["chroot", rootfs, "depmod", kernel.version])  # the root's own kmod (hosts may lack it)
    return kernel.version


def _unpack_package(package: str, tmp: Path, progress: Progress) -> Path:
    """Downloads a Debian package with apt into `tmp` and unpacks it; returns its root."""
    progress(f"downloading {package}")
    run(["apt-get", "download", package], cwd=tmp, progress=None)
    deb = next(tmp.glob("*.deb"))
    progress(f"unpacking {deb.name}")
    root = tmp / "root"
    run(["dpkg-deb", "-x", deb, root])
    return root


def _save_tree(root: Path, version: str, dest: Path) -> None:
    tmp = dest.with_suffix(".tmp")
    with tarfile.open(tmp, "w") as tar:
        tar.add(root / "lib" / "modules" / version, arcname=version)
    tmp.rename(dest)


def _resolve_package() -> str:
    out = subprocess.run(
        ["apt-cache", "depends", META_PACKAGE], capture_output=True, text=True, check=False
    ).stdout
    match = re.search(r"Depends: (linux-image-[\w.+-]+)", out)
    if not match:
        run(["apt-get", "update", "-q"])
        out = subprocess.run(
            ["apt-cache", "depends", META_PACKAGE], capture_output=True, text=True, check=False
        ).stdout
        match = re.search(r"Depends: (linux-image-[\w.+-]+)", out)
    if not match:
        raise errors.BuildFailed(f"cannot resolve {META_PACKAGE} from the apt sources")
    return match.group(1)


def extract_vmlinux(vmlinuz: Path, dest: Path) -> None:
    """Finds the LZ4 payload in a bzImage and decompresses it to the ELF kernel."""
    data = vmlinuz.read_bytes()
    offset = data.find(LZ4_LEGACY_MAGIC)
    if offset < 0:
        raise errors.BuildFailed(f"{vmlinuz.name}: no LZ4 payload found")
    with dest.open("wb") as out:
        # lz4 exits non-zero on the bzImage trailer after the stream; the ELF check decides
        subprocess.run(["lz4", "-dc"], input=data[offset:], stdout=out, check=False)
    with dest.open("rb") as f:
        if f.read(4) != b"\x7fELF":
            raise errors.BuildFailed(f"{vmlinuz.name}: decompressed payload is not an ELF")


def _copy_modules(root: Path, version: str, dest: Path) -> list[str]:
    """Copies the wanted modules and everything they depend on, in load order.

    Dependencies come from each module's own `.modinfo` (`depends=`), so no depmod is needed.
    """
    moddir = root / "lib" / "modules" / version
    index = {_modname(p.name): p for p in moddir.rglob("*.ko")}
    order: list[Path] = []

    def visit(name: str) -> None:
        ko = index.get(_modname(name))
        if ko is None:
            raise errors.BuildFailed(f"kernel {version} has no module {name}")
        if ko in order:
            return
        for dep in _depends(ko):
            visit(dep)
        order.append(ko)

    for name in WANTED_MODULES:
        visit(name)
    for ko in order:
        shutil.copy2(ko, dest / ko.name)
    return [ko.name for ko in order]


def _modname(name: str) -> str:
    return name.removesuffix(".ko").replace("-", "_")


def _depends(ko: Path) -> list[str]:
    match = re.search(rb"\x00depends=([^\x00]*)\x00", ko.read_bytes())
    return [d for d in match.group(1).decode().split(",") if d] if match else []
