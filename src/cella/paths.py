"""Where cella keeps its files. One data directory holds images, VMs and (later) state."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_DATA_DIR = Path("/var/lib/cella")


def default_data_dir() -> Path:
    return Path(os.environ.get("CELLA_DATA_DIR") or DEFAULT_DATA_DIR)


@dataclass(frozen=True, slots=True)
class Paths:
    root: Path

    @classmethod
    def default(cls) -> Paths:
        return cls(default_data_dir())

    @property
    def images(self) -> Path:
        return self.root / "images"

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

    def ensure(self) -> None:
        for d in (self.images, self.kernel, self.templates, self.vms, self.tmp):
            d.mkdir(parents=True, exist_ok=True)
