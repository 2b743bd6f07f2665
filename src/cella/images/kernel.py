"""The guest kernel: built here from Debian's kernel source package for the microvm.

`make allnoconfig` with `microvm.config` forced on gives a kernel with every driver the
microvm, the agent and the templates use built in and nothing else, so a cold boot under
emulation spends no time on initcalls of hardware that is not there or on loading modules.
The patches in `kernel-patches/` go on first (a boot parameter that skips a calibration).
The ELF `vmlinux` boots through PVH. It is cached by the source package's version and the
digest of the configuration and patches: a change to either builds again.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from cella import errors
from cella._proc import Progress, quiet, run
from cella.images.stock_kernel import MODULE_DIR, ORDER, stock_dir
from cella.paths import Paths

SOURCE_META_PACKAGE = "linux-source"  # depends on linux-source-X.Y, the newest of the suite
LOCALVERSION = "-cella"
MODULES_TAR = "modules.tar"  # /lib/modules/VERSION (the built-in modules' index), for templates


@dataclass(frozen=True, slots=True)
class Kernel:
    version: str
    vmlinux: Path  # what QEMU's -kernel boots: the ELF vmlinux (tuned) or a bzImage (stock)
    sha256: str
    build_sha256: str
    source: str  # the Debian package it was built from or unpacked
    kind: str = "tuned"  # "tuned": compiled here (kernel.py); "stock": Debian's (stock_kernel.py)
    modules: tuple[Path, ...] = ()  # a stock kernel's drivers, in load order

    @classmethod
    def load(cls, paths: Paths) -> Kernel:
        """The kernel new VMs boot: cella's own once it is built, else the stock one."""
        try:
            return cls.tuned(paths)
        except errors.ImageMissing:
            stock = cls.stock(paths)
            if stock is None:
                raise
            return stock

    @classmethod
    def stock(cls, paths: Paths) -> Kernel | None:
        folder = stock_dir(paths)
        if not (folder / "kernel.json").exists():
            return None
        data = json.loads((folder / "kernel.json").read_text())
        order = (folder / ORDER).read_text().split()
        return cls(
            version=data["version"],
            vmlinux=folder / "vmlinuz",
            sha256=data["sha256"],
            build_sha256="",
            source=data["source"],
            kind="stock",
            modules=tuple(folder / MODULE_DIR / name for name in order),
        )

    @classmethod
    def tuned(cls, paths: Paths) -> Kernel:
        meta = paths.kernel / "kernel.json"
        if not meta.exists():
            raise errors.ImageMissing("no guest kernel yet: run `cella setup`")
        data = json.loads(meta.read_text())
        if "build_sha256" not in data:  # cached by an older release: a different kernel
            raise errors.ImageMissing("the guest kernel is out of date: run `cella setup`")
        return cls(
            version=data["version"],
            vmlinux=paths.kernel / "vmlinux",
            sha256=data["sha256"],
            build_sha256=data["build_sha256"],
            source=data.get("source", ""),
        )


def config_fragment() -> bytes:
    return resources.files("cella.images").joinpath("microvm.config").read_bytes()


def patches() -> list[tuple[str, bytes]]:
    """The patches applied to the kernel source before it is configured, in name order."""
    folder = resources.files("cella.images").joinpath("kernel-patches")
    found = [p for p in folder.iterdir() if p.name.endswith(".patch")]
    return [(p.name, p.read_bytes()) for p in sorted(found, key=lambda p: p.name)]


def build_digest() -> str:
    """What decides the built kernel: its configuration and its patches."""
    h = hashlib.sha256(config_fragment())
    for name, data in patches():
        h.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    return h.hexdigest()


def tuned_is_current(paths: Paths) -> bool:
    """Whether cella's own kernel is built for this configuration (no apt asked: quick)."""
    try:
        return Kernel.tuned(paths).build_sha256 == build_digest()
    except errors.ImageMissing:
        return False


def ensure_kernel(paths: Paths, progress: Progress = quiet) -> Kernel:
    """Builds the kernel once; later calls return the cached one while its source package's
    version (a Debian security update), configuration and patches are unchanged."""
    wanted = build_digest()
    try:
        cached: Kernel | None = Kernel.tuned(paths)
    except errors.ImageMissing:
        cached = None
    try:
        package, source_version = _resolve_source()
    except errors.BuildFailed:
        if cached is None:
            raise
        return cached  # no apt sources to ask: what is built stays
    source = f"{package} {source_version}"
    if cached is not None:
        if cached.build_sha256 == wanted and cached.source == source:
            return cached
        progress(f"the guest kernel is out of date ({source}, configuration, patches)")
    paths.ensure()
    with tempfile.TemporaryDirectory(dir=paths.build_tmp, prefix="kernel-") as tmp_s:
        tmp = Path(tmp_s)
        tree = _unpack_source(package, tmp, progress)
        stage = tmp / "kernel"
        stage.mkdir()
        version = build(tree, stage, progress)
        digest = hashlib.sha256((stage / "vmlinux").read_bytes()).hexdigest()
        (stage / "kernel.json").write_text(
            json.dumps(
                {
                    "version": version,
                    "source": source,
                    "sha256": digest,
                    "build_sha256": wanted,
                },
                indent=2,
            )
        )
        # swap in the finished directory whole: a failed run leaves nothing half-written
        if paths.kernel.exists():
            shutil.rmtree(paths.kernel)
        stage.rename(paths.kernel)
    progress(f"guest kernel {version} ready")
    return Kernel.tuned(paths)


def build(tree: Path, dest: Path, progress: Progress = quiet) -> str:
    """Patches, configures and compiles the pristine kernel source `tree`; puts `vmlinux`,
    `config` and the module index (MODULES_TAR) into `dest`. Returns the kernel's release."""
    for name, patch in patches():
        progress(f"applying {name}")
        done = subprocess.run(
            ["patch", "-p1", "--forward"], input=patch, cwd=tree, capture_output=True
        )
        if done.returncode != 0:
            raise errors.BuildFailed(f"{name} does not apply:\n{done.stdout.decode()[-2000:]}")
    fragment = config_fragment()
    (tree / "cella.config").write_bytes(fragment)
    make = ["make", "-C", str(tree), f"LOCALVERSION={LOCALVERSION}"]
    progress("configuring the guest kernel")
    run([*make, "allnoconfig", "KCONFIG_ALLCONFIG=cella.config"])
    unmet = unmet_options(fragment.decode(), (tree / ".config").read_text())
    if unmet:
        raise errors.BuildFailed(
            "the kernel configuration does not take these options (a dependency is missing): "
            + ", ".join(unmet)
        )
    jobs = str(os.cpu_count() or 1)
    compiled = 0

    def count(line: str) -> None:
        nonlocal compiled
        if line.lstrip().startswith("CC "):
            compiled += 1
            if compiled % 100 == 0:
                progress(f"compiling the guest kernel: {compiled} files")

    progress(f"compiling the guest kernel on {jobs} cores (minutes; done once)")
    run([*make, f"-j{jobs}", "vmlinux", "modules"], progress=count)
    mods = dest / "modroot"
    run([*make, "modules_install", f"INSTALL_MOD_PATH={mods}", "DEPMOD=true"])
    version = run([*make, "-s", "kernelrelease"]).strip().splitlines()[-1]
    shutil.copy2(tree / "vmlinux", dest / "vmlinux")
    shutil.copy2(tree / ".config", dest / "config")
    _save_tree(mods / "lib" / "modules" / version, dest / MODULES_TAR)
    shutil.rmtree(mods)
    return version


def unmet_options(fragment: str, config: str) -> list[str]:
    """The fragment's options that the resolved `.config` does not have as asked."""
    have: dict[str, str] = {}
    for line in config.splitlines():
        if line.startswith("CONFIG_"):
            key, _, value = line.partition("=")
            have[key] = value
        elif m := re.fullmatch(r"# (CONFIG_\w+) is not set", line):
            have[m.group(1)] = "n"
    unmet = []
    for line in fragment.splitlines():
        if not line.startswith("CONFIG_"):
            continue
        key, _, value = line.strip().partition("=")
        if have.get(key, "n") != value:
            unmet.append(f"{key}={value}")
    return unmet


def install_modules(paths: Paths, rootfs: Path, progress: Progress = quiet) -> str:
    """Puts the guest kernel's module index into a root file system, for templates whose
    programs load modules (Docker: overlay, bridge, netfilter...): all are built in, and with
    the index `modprobe` finds them so. The root must have kmod. Returns the kernel version.
    Only cella's own kernel has such an index: a template that needs it waits for that one."""
    kernel = Kernel.tuned(paths)
    progress(f"adding the module index of kernel {kernel.version}")
    (rootfs / "lib" / "modules").mkdir(parents=True, exist_ok=True)
    with tarfile.open(paths.kernel / MODULES_TAR) as tar:
        tar.extractall(rootfs / "lib" / "modules", filter="tar")
    run(["chroot", rootfs, "depmod", kernel.version])  # the root's own kmod (hosts may lack it)
    return kernel.version


def _resolve_source() -> tuple[str, str]:
    """The kernel source package of the host's suite and its version."""
    for attempt in range(2):
        out = subprocess.run(
            ["apt-cache", "depends", SOURCE_META_PACKAGE],
            capture_output=True,
            text=True,
            check=False,
        ).stdout
        match = re.search(r"Depends: (linux-source-[\w.+-]+)", out)
        if match:
            package = match.group(1)
            policy = subprocess.run(
                ["apt-cache", "policy", package], capture_output=True, text=True, check=False
            ).stdout
            version = re.search(r"Candidate: (\S+)", policy)
            return package, version.group(1) if version else "unknown"
        if attempt == 0:
            run(["apt-get", "update", "-q"])
    raise errors.BuildFailed(f"cannot resolve {SOURCE_META_PACKAGE} from the apt sources")


def _unpack_source(package: str, tmp: Path, progress: Progress) -> Path:
    """Downloads the source package with apt and unpacks its tarball; returns the tree."""
    progress(f"downloading {package}")
    run(["apt-get", "download", package], cwd=tmp)
    deb = next(tmp.glob("*.deb"))
    root = tmp / "pkg"
    run(["dpkg-deb", "-x", deb, root])
    deb.unlink()
    tarball = next((root / "usr" / "src").glob("linux-source-*.tar.*"))
    progress(f"unpacking {tarball.name}")
    run(["tar", "-xf", tarball, "-C", tmp])
    shutil.rmtree(root)
    return next(p for p in tmp.glob("linux-source-*") if p.is_dir())


def _save_tree(moddir: Path, dest: Path) -> None:
    # without `build` and `source`: links into the build tree, which is gone afterwards
    links = {f"{moddir.name}/build", f"{moddir.name}/source"}
    tmp = dest.with_suffix(".tmp")
    with tarfile.open(tmp, "w") as tar:
        tar.add(moddir, arcname=moddir.name, filter=lambda m: None if m.name in links else m)
    tmp.rename(dest)
