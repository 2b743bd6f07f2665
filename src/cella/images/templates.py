"""Templates: root file systems declared as data, built with mmdebstrap, cached by hash.

A template becomes a read-only qcow2 base image; every sandbox writes to its own overlay on
top of it. The image name carries the hash of the spec, so an unchanged template is never
rebuilt and a changed one never reuses a stale image. A build happens in a scratch directory
and is renamed into the cache only when complete.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import tomllib
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

from pydantic import BaseModel, Field

from cella import errors
from cella._proc import Progress, quiet, run
from cella.config import DaemonSettings
from cella.models import ImageConfig, StartCommand
from cella.paths import Paths

# Bump when the build steps change in a way that changes the resulting image
# (2: mmdebstrap, whose root has no apt lists left, instead of debootstrap).
BUILDER_VERSION = 2
_SHAPE = {"vcpus", "memory_mib"}  # fields of a sandbox's shape, not of the image
_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")


class TemplateSpec(BaseModel):
    """What goes into a template image."""

    name: str
    suite: str = "bookworm"
    apt_packages: list[str] = Field(default_factory=list)
    # installed with apt-get into the finished root: packages whose maintainer scripts need a
    # configured system, which the bootstrap's own install does not give them
    apt_install: list[str] = Field(default_factory=list)
    pip_packages: list[str] = Field(default_factory=list)
    files: dict[str, str] = Field(default_factory=dict)  # absolute guest path -> content
    setup: list[str] = Field(default_factory=list)  # shell commands run in the new root
    kernel_modules: bool = False  # the guest kernel's module index goes into /lib/modules
    warm: list[str] = Field(
        default_factory=list,
        description="shell commands run in the booted guest before its warm snapshot is "
        "taken: what they start (e.g. dockerd) is running in every sandbox restored from it",
    )
    disk_mib: int = Field(default=4096, ge=512, le=1 << 20)
    # a sandbox's shape unless its create asks otherwise (a desktop's browser wants room);
    # not part of the image, so not of its digest
    vcpus: int | None = Field(default=None, ge=1, le=64)
    memory_mib: int | None = Field(default=None, ge=128, le=1 << 20)

    def digest(self, kernel: str = "") -> str:
        """Of everything that goes into the image (`kernel`: the module index's kernel)."""
        fields = {"builder": BUILDER_VERSION, **self.model_dump(exclude=_SHAPE), "kernel": kernel}
        for later in ("apt_install", "kernel_modules", "warm", "kernel"):  # added unset: the
            if not fields[later]:  # digests (and images) of templates without them stay
                del fields[later]
        canon = json.dumps(fields, sort_keys=True).encode()
        return hashlib.sha256(canon).hexdigest()[:16]

    @classmethod
    def from_toml(cls, text: str) -> TemplateSpec:
        return cls.model_validate(tomllib.loads(text))


def builtin_templates() -> dict[str, TemplateSpec]:
    """The templates shipped with cella. Their `files_from` name files of this package
    (e.g. a guest program kept as checked Python) that become `files`, content and all.
    Read once: they are files of the installed package (a create asks for its shape); the
    specs are shared, to read, not to change."""
    return dict(_shipped())


@functools.cache
def _shipped() -> dict[str, TemplateSpec]:
    specs = {}
    package = resources.files("cella.images")
    for entry in package.joinpath("templates").iterdir():
        if entry.name.endswith(".toml"):
            data = tomllib.loads(entry.read_text())
            for path, source in data.pop("files_from", {}).items():
                data.setdefault("files", {})[path] = package.joinpath(source).read_text()
            spec = TemplateSpec.model_validate(data)
            specs[spec.name] = spec
    return specs


def default_shape(name: str) -> dict[str, int]:
    """The `vcpus` / `memory_mib` a built-in template's sandboxes get unless asked."""
    spec = builtin_templates().get(name)
    if spec is None:
        return {}
    return {k: v for k in sorted(_SHAPE) if (v := getattr(spec, k)) is not None}


def template_image(paths: Paths, spec: TemplateSpec) -> Path:
    return paths.templates / f"{spec.name}-{_digest(paths, spec)}.qcow2"


def _digest(paths: Paths, spec: TemplateSpec) -> str:
    if not spec.kernel_modules:
        return spec.digest()
    from cella.images.kernel import Kernel

    try:  # the module index follows the kernel's release and configuration, not its bytes
        kernel = Kernel.tuned(paths)  # the only kernel with a module index
        return spec.digest(f"{kernel.version} {kernel.build_sha256}")
    except errors.ImageMissing:
        return spec.digest("none")


def start_of(paths: Paths, name: str) -> tuple[StartCommand, ImageConfig] | None:
    """What a template built from an image has running in its warm snapshot (and the
    image's config it runs with); None for a built-in template or one without."""
    if name in builtin_templates():
        return None
    from cella.images.oci import read_meta

    meta = read_meta(paths, name)
    if meta is None or meta.start is None:
        return None
    return meta.start, meta.config


def find_template(paths: Paths, name: str) -> Path:
    """The built base image of a built-in template, or ImageMissing / NotFound."""
    specs = builtin_templates()
    if name not in specs:
        from cella.images.oci import read_meta  # templates built from images

        meta = read_meta(paths, name)
        if meta is None:
            raise errors.NotFound(f"unknown template {name!r}")
        return paths.image_templates / meta.image
    image = template_image(paths, specs[name])
    if not image.exists():
        raise errors.ImageMissing(f"template {name!r} is not built: run `cella setup`")
    return image


def debian_mirror(suite: str) -> str:
    """The configured mirror (`CELLA_DEBIAN_MIRROR`, see `cella.config`), else the host's own
    Debian mirror for `suite`, read from its apt sources."""
    if mirror := DaemonSettings().debian_mirror:
        return mirror
    for source in _apt_sources():
        uri, suites, components = source
        if suite in suites and "main" in components:
            return uri
    raise errors.BuildFailed(f"no apt source for Debian {suite} main (set CELLA_DEBIAN_MIRROR)")


def _apt_sources() -> Iterator[tuple[str, list[str], list[str]]]:
    apt = Path("/etc/apt")
    lists = [apt / "sources.list", *sorted((apt / "sources.list.d").glob("*.list"))]
    for f in lists:
        if not f.exists():
            continue
        for line in f.read_text().splitlines():
            parts = re.sub(r"\[[^]]*\]", "", line.split("#")[0]).split()
            if len(parts) >= 3 and parts[0] == "deb":
                yield parts[1], [parts[2]], parts[3:]
    for f in sorted((apt / "sources.list.d").glob("*.sources")):
        for stanza in re.split(r"\n\s*\n", f.read_text()):
            kv: dict[str, str] = {}
            for line in stanza.splitlines():
                if ":" in line and not line.startswith(("#", " ")):
                    k, _, v = line.partition(":")
                    kv[k.strip().lower()] = v.strip()
            if "deb" in kv.get("types", "").split():
                for uri in kv.get("uris", "").split():
                    yield uri, kv.get("suites", "").split(), kv.get("components", "").split()


def build_template(
    paths: Paths, spec: TemplateSpec, progress: Progress = quiet, *, force: bool = False
) -> Path:
    """Builds the template's base image unless an identical one is cached."""
    if not _NAME.match(spec.name):
        raise errors.InvalidArgument(f"invalid template name {spec.name!r}")
    image = template_image(paths, spec)
    if image.exists() and not force:
        progress(f"template {spec.name} is up to date ({image.name})")
        return image
    paths.ensure()
    stage = paths.build_tmp / f"template-{spec.name}-{_digest(paths, spec)}-{os.getpid()}"
    if stage.exists():
        _remove_stage(stage)
    rootfs = stage / "rootfs"
    rootfs.mkdir(parents=True)
    try:
        mirror = debian_mirror(spec.suite)
        packages = ["ca-certificates", *spec.apt_packages]
        progress(f"mmdebstrap {spec.suite} ({len(packages)} extra packages)")
        run(
            [
                "mmdebstrap",  # a few times faster than debootstrap: what a first start waits for
                "--variant=minbase",
                # no fsync per unpacked file: a root that fails half-way is thrown away anyway
                "--dpkgopt=force-unsafe-io",
                f"--include={','.join(packages)}",
                spec.suite,
                rootfs,
                mirror,
            ],
            progress=lambda line: progress(f"  {line}") if line.startswith("I:") else None,
        )
        if spec.kernel_modules:
            from cella.images.kernel import install_modules

            install_modules(paths, rootfs, progress)
        _configure(rootfs, spec, progress)
        raw = stage / "root.ext4"
        progress(f"making a {spec.disk_mib} MiB ext4 file system")
        run(
            [
                "mkfs.ext4",
                "-F",
                "-q",
                "-L",
                "cella-root",
                "-E",
                "root_owner=0:0",
                "-d",
                rootfs,
                raw,
                f"{spec.disk_mib}M",
            ]
        )
        progress("converting to a qcow2 base image")
        qcow = stage / "base.qcow2"
        run(["qemu-img", "convert", "-O", "qcow2", raw, qcow])
        qcow.chmod(0o400)
        (stage / "spec.json").write_text(spec.model_dump_json(indent=2))
        shutil.copy2(stage / "spec.json", image.with_suffix(".json"))
        qcow.rename(image)
    finally:
        _remove_stage(stage)
    progress(f"template {spec.name} built ({image.name})")
    return image


def _configure(rootfs: Path, spec: TemplateSpec, progress: Progress) -> None:
    (rootfs / "etc" / "hostname").write_text("cella\n")
    (rootfs / "etc" / "hosts").write_text("127.0.0.1 localhost cella\n::1 localhost\n")
    (rootfs / "workspace").mkdir(exist_ok=True)
    with _chroot_mounts(rootfs):
        resolv = rootfs / "etc" / "resolv.conf"
        resolv.unlink(missing_ok=True)
        shutil.copy2("/etc/resolv.conf", resolv)  # for pip during the build only
        try:
            if spec.apt_install:
                progress(f"apt-get install {' '.join(spec.apt_install)}")
                _chroot(rootfs, ["apt-get", "update", "-q"], progress)
                _chroot(rootfs, ["apt-get", "install", "-y", "-q", "--no-install-recommends",
                                 *spec.apt_install], progress)  # fmt: skip
            if spec.pip_packages:
                progress(f"pip install {' '.join(spec.pip_packages)}")
                _chroot(
                    rootfs,
                    [
                        "python3",
                        "-m",
                        "pip",
                        "install",
                        "--no-cache-dir",
                        "--break-system-packages",
                        *spec.pip_packages,
                    ],
                    progress,
                )
            for path, content in spec.files.items():
                if not path.startswith("/") or ".." in Path(path).parts:
                    raise errors.InvalidArgument(f"template file path {path!r} is not absolute")
                dest = rootfs / path.lstrip("/")
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_text(content)
            for command in spec.setup:
                progress(f"setup: {command}")
                _chroot(rootfs, ["/bin/sh", "-c", command], progress)
            _chroot(rootfs, ["apt-get", "clean"], progress)
        finally:
            resolv.write_text("")
    shutil.rmtree(rootfs / "var" / "lib" / "apt" / "lists", ignore_errors=True)
    (rootfs / "var" / "lib" / "apt" / "lists" / "partial").mkdir(parents=True, exist_ok=True)


def _chroot(rootfs: Path, cmd: list[str], progress: Progress) -> None:
    env = {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": "/root",
        "LANG": "C.UTF-8",
        "DEBIAN_FRONTEND": "noninteractive",
    }
    run(["chroot", rootfs, *cmd], env=env, progress=lambda line: progress(f"  {line}"))


@contextlib.contextmanager
def _chroot_mounts(rootfs: Path) -> Iterator[None]:
    mounted: list[Path] = []
    try:
        for fs, target in (("proc", "proc"), ("sysfs", "sys")):
            subprocess.run(["mount", "-t", fs, fs, rootfs / target], check=True)
            mounted.append(rootfs / target)
        subprocess.run(["mount", "--bind", "/dev", rootfs / "dev"], check=True)
        mounted.append(rootfs / "dev")
        yield
    finally:
        for m in reversed(mounted):
            subprocess.run(["umount", "-l", m], check=False)


def _remove_stage(stage: Path) -> None:
    # never delete through a bind mount of the host's /dev
    mounts = Path("/proc/self/mounts").read_text()
    if f" {stage}/" in mounts:
        raise errors.BuildFailed(f"{stage} still has mounts; not removing it")
    shutil.rmtree(stage, ignore_errors=True)
