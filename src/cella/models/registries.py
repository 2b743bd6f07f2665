"""Image registries on the wire: a tenant's credentials for pulling images, kept on the host
(the password is write-only: no answer carries it)."""

from __future__ import annotations

import re
from datetime import datetime

from pydantic import BaseModel, Field, field_validator

from cella.models.network import SECRET_NAME

# a registry host, with a port if any (`registry.example.com`, `10.0.0.1:5000`); an
# `https://` prefix and a trailing path are taken off
_HOST = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,252})(:[0-9]{1,5})?$")


def registry_host(url: str) -> str:
    """The host (and port) of a registry URL, as image references name it."""
    host = url.strip().removeprefix("https://").removeprefix("http://").split("/", 1)[0]
    if not _HOST.fullmatch(host):
        raise ValueError(f"{url!r} is not a registry host (host or host:port)")
    return host.lower()


class RegistryCreate(BaseModel):
    """Where a tenant's private images are pulled from, and as whom."""

    model_config = {"extra": "forbid"}

    name: str = Field(pattern=SECRET_NAME)
    url: str = Field(min_length=1, max_length=256, description="the registry's host[:port]")
    username: str | None = Field(default=None, min_length=1, max_length=256)
    password: str | None = Field(default=None, min_length=1, max_length=65536)

    @field_validator("url")
    @classmethod
    def _host(cls, url: str) -> str:
        return registry_host(url)


class RegistryUpdate(BaseModel):
    """Fields given replace the registry's; credentials are replaced together."""

    model_config = {"extra": "forbid"}

    name: str | None = Field(default=None, pattern=SECRET_NAME)
    url: str | None = Field(default=None, min_length=1, max_length=256)
    username: str | None = Field(default=None, min_length=1, max_length=256)
    password: str | None = Field(default=None, min_length=1, max_length=65536)

    @field_validator("url")
    @classmethod
    def _host(cls, url: str | None) -> str | None:
        return None if url is None else registry_host(url)


class Registry(BaseModel):
    model_config = {"from_attributes": True}

    id: str
    name: str
    url: str
    username: str | None = None
    created_at: datetime
    updated_at: datetime


class RegistryList(BaseModel):
    registries: list[Registry]


class SnapshotFromImage(BaseModel):
    """A snapshot built from a registry image: a template of the caller's alone, booted once
    and snapshotted. It answers at once, `creating`; poll the snapshot until `ready`."""

    model_config = {"extra": "forbid"}

    name: str = Field(min_length=1, max_length=128)
    image: str = Field(min_length=1, max_length=1024, description="host/repo:tag or @sha256")
    tag: str | None = Field(default=None, min_length=1, max_length=128)
    disk_mib: int | None = Field(default=None, ge=512, le=1 << 20)
    registry: str | None = Field(
        default=None, max_length=128, description="one of the caller's registries (id or name)"
    )
