"""Where cella keeps its files.

The data directory holds one daemon's state and VMs. The image cache (kernel, initramfs,
template bases) is content-addressed and read-only once built, so daemons with different data
directories share it: it defaults to the default data directory's `images/`.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from cella.config import DEFAULT_DATA_DIR, DaemonSettings

__all__ = ["DEFAULT_DATA_DIR", "Paths", "default_data_dir", "default_image_dir", "owner_only"]


_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_ENTRY = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC  # the entry itself, never a link's target
# an entry that vanished, refuses even root (a mounted /proc), or was swapped meanwhile
_PASS_OVER = frozenset({errno.ENOENT, errno.EACCES, errno.EPERM, errno.ELOOP, errno.ENOTDIR})


def owner_only(root: Path, vm_group: int | None = None, *, skip: Collection[Path] = ()) -> int:
    """Takes every group and other permission off `root` and what is under it (tenants'
    memory, disks, secrets and logs live there), except group access to the files jailed
    QEMUs share (group `vm_group`); returns how many entries it changed.

    Every start runs it, beside other processes using the same trees, so it descends only
    into directories that were open to others (nothing under a closed one is reachable, and
    it was walked when it was closed: later starts look at the top alone), never into
    `skip` (build scratch: a running build's chroot), never across a mount point or through
    a link, and passes over entries that vanish or refuse."""
    try:  # the root is the operator's (it may be a link); what is under it is walked
        top = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in _PASS_OVER:
            return 0
        raise
    device = os.fstat(top).st_dev
    was_open, changed = _tighten(top, vm_group)
    frames = [(top, root, iter(_names(top) if was_open else []))]
    try:
        while frames:
            dir_fd, path, names = frames[-1]
            name = next(names, None)
            if name is None:
                os.close(frames.pop()[0])
                continue
            try:
                entry = os.open(name, _ENTRY, dir_fd=dir_fd)
            except OSError as exc:
                if exc.errno in _PASS_OVER:
                    continue
                raise
            try:
                st = os.fstat(entry)
                if stat.S_ISLNK(st.st_mode) or st.st_dev != device:
                    continue  # a link, or another file system mounted here
                was_open, tightened = _tighten(entry, vm_group)
                changed += tightened
                if was_open and stat.S_ISDIR(st.st_mode) and path / name not in skip:
                    sub = os.open(".", _DIR, dir_fd=entry)  # the very directory checked
                    frames.append((sub, path / name, iter(_names(sub))))
            finally:
                os.close(entry)
    finally:
        for dir_fd, _, _ in frames:
            os.close(dir_fd)
    return changed


def _tighten(fd: int, vm_group: int | None) -> tuple[bool, int]:
    """Takes group/other bits off what `fd` holds; whether it had any, and whether they
    went (a file system may refuse)."""
    st = os.fstat(fd)
    mask = 0o007 if vm_group is not None and st.st_gid == vm_group else 0o077
    if not st.st_mode & mask:
        return False, 0
    try:  # through the descriptor: a name could be swapped for a link meanwhile
        os.chmod(f"/proc/self/fd/{fd}", stat.S_IMODE(st.st_mode) & ~mask)
    except OSError as exc:
        if exc.errno not in _PASS_OVER:
            raise
        return True, 0
    return True, 1


def _names(dir_fd: int) -> list[str]:
    try:
        return os.listdir(dir_fd)
    except OSError as exc:
        if exc.errno in _PASS_OVER:
            return []
        raise


def default_data_dir() -> Path:
    """`CELLA_DATA_DIR` (or the TOML file's `data_dir`), else /var/lib/cella."""
    return DaemonSettings().data_dir


def default_image_dir() -> Path:
    """`CELLA_IMAGE_DIR` (or the TOML file's `image_dir`), else /var/lib/cella/images."""
    return DaemonSettings().image_dir


@dataclass(frozen=True, slots=True)
class Paths:
    root: Path
    image_dir: Path | None = None
    template_dir: Path | None = None  # templates built from images, if not the cache's

    @classmethod
    def default(cls) -> Paths:
        """The directories of the daemon settings (`cella.config.DaemonSettings`)."""
        settings = DaemonSettings()
        return cls(settings.data_dir, settings.image_dir, settings.own_template_dir())

    @property
    def images(self) -> Path:
        return self.image_dir or self.root / "images"

    @property
    def kernel(self) -> Path:
        return self.images / "kernel"

    @property
    def templates(self) -> Path:
        return self.images / "templates"

    @property
    def image_templates(self) -> Path:
        """Templates built from images (records and bases): the image cache's unless the
        daemon keeps its own (a fleet's node whose cache other nodes share)."""
        return self.template_dir or self.templates

    def warm_snapshots(self, builtin: bool) -> Path:
        """Where a template's warm snapshots live: beside its base when the daemon keeps
        its own templates (their disks sit on it), else in the shared cache."""
        if builtin or self.template_dir is None:
            return self.images / "snapshots"
        return self.template_dir / "warm"

    @property
    def vms(self) -> Path:
        return self.root / "vms"

    @property
    def tmp(self) -> Path:
        return self.root / "tmp"

    @property
    def build_tmp(self) -> Path:
        """Scratch space for image builds, on the same file system as the cache."""
        return self.images / "tmp"

    def ensure(self) -> None:
        dirs = (self.images, self.kernel, self.templates, self.image_templates, self.vms,
                self.tmp, self.build_tmp)  # fmt: skip
        for d in dirs:
            d.mkdir(parents=True, exist_ok=True)
