"""Where cella keeps its files.

The data directory holds one daemon's state and VMs. The image cache (kernel, initramfs,
template bases) is content-addressed and read-only once built, so daemons with different data
directories share it: it defaults to the default data directory's `images/`.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from cella.config import DEFAULT_DATA_DIR, DaemonSettings

__all__ = ["DEFAULT_DATA_DIR", "Paths", "default_data_dir", "default_image_dir", "owner_only"]


def owner_only(root: Path, vm_group: int | None = None) -> int:
    """Takes every group and other permission off `root` and everything under it (tenants'
    memory, disks, secrets and logs live there), except group access to the files jailed
    QEMUs share (group `vm_group`); returns how many entries it changed."""
    changed = 0
    if not root.exists():
        return 0
    for top, dirs, files in os.walk(root):
        for name in [top, *(os.path.join(top, n) for n in dirs + files)]:
            try:
                st = os.lstat(name)
                if stat.S_ISLNK(st.st_mode):
                    continue
                mask = 0o007 if vm_group is not None and st.st_gid == vm_group else 0o077
                if st.st_mode & mask:
                    os.chmod(name, stat.S_IMODE(st.st_mode) & ~mask)
                    changed += 1
            except FileNotFoundError:
                continue  # gone meanwhile
    return changed


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

    @classmethod
    def default(cls) -> Paths:
        """The directories of the daemon settings (`cella.config.DaemonSettings`)."""
        settings = DaemonSettings()
        return cls(settings.data_dir, settings.image_dir)

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
        for d in (self.images, self.kernel, self.templates, self.vms, self.tmp, self.build_tmp):
            d.mkdir(parents=True, exist_ok=True)
