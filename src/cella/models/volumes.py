"""Volumes: a tenant's persistent file trees, kept by the daemon on the host, which outlive
sandboxes and are mounted by several at once. In the guest a volume is a network file system
(rclone over WebDAV) whose requests go out through the egress proxy to the daemon, which
serves only the volumes the sandbox mounts, read-only ones without writes."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field, field_validator

from cella.models.mounts import mount_path

VOLUME_NAME = r"^[A-Za-z0-9_-]{1,63}$"  # E2B's names (`^[a-zA-Z0-9_-]+$`), bounded
VOLUME_ID = r"^vol-[0-9a-f]{16}$"

MAX_VOLUME_MOUNTS = 8


class VolumeCreate(BaseModel):
    model_config = {"extra": "forbid"}

    name: str = Field(pattern=VOLUME_NAME, description="unique in the tenant")


class Volume(BaseModel):
    """A volume; `size_bytes` is what its files hold now, `used_by` the sandboxes (not
    deleted) that mount it."""

    model_config = {"from_attributes": True}

    id: str
    name: str
    created_at: datetime
    size_bytes: int = 0
    used_by: list[str] = Field(default_factory=list)


class VolumeList(BaseModel):
    volumes: list[Volume]
    quota_bytes: int | None = Field(description="the tenant's bound over all its volumes")
    used_bytes: int


class VolumeMount(BaseModel):
    """A volume mounted at `path` in the guest; `volume` is its id or name (stored as its id
    once the sandbox is made). `read_only`: the daemon refuses the sandbox's writes to it."""

    model_config = {"extra": "forbid", "from_attributes": True}

    volume: str = Field(min_length=1, max_length=63)
    path: str = Field(min_length=2, max_length=4096, description="absolute path in the guest")
    read_only: bool = False

    _path = field_validator("path")(mount_path)

    @property
    def id(self) -> str:
        """Its key among the sandbox's mounts (and in `mount_states`)."""
        return f"volume-{self.volume}"


class RemoteVolumeLend(BaseModel):
    """A volume of another node of a fleet, lent to this node by the gateway so that its
    sandboxes mount it: the home node daemon's URL and certificate, the volume's token
    there."""

    model_config = {"extra": "forbid"}

    tenant: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]{0,62}$")
    name: str = Field(pattern=VOLUME_NAME)
    url: str = Field(pattern=r"^https?://", max_length=2048)
    token: str = Field(min_length=1, max_length=1024)
    ca_pem: str = Field(default="", max_length=65536)


class VolumeEntry(BaseModel):
    """A file or directory of a volume (`path` from the volume's root, `/`-led)."""

    name: str
    path: str
    type: Literal["file", "directory"]
    size: int
    mode: int
    mtime: datetime
    ctime: datetime
    atime: datetime


class VolumeEntryList(BaseModel):
    entries: list[VolumeEntry]


def volume_path(value: str) -> str:
    """A path inside a volume, `/`-led and normalised; `..`, NUL and empty parts refused."""
    parts = [p for p in value.replace("\\", "/").split("/") if p not in ("", ".")]
    if "\x00" in value or ".." in parts or len(value) > 4096:
        raise ValueError(f"invalid volume path {value!r}: no '..' or NUL")
    return "/" + "/".join(parts)
