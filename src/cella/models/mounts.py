"""A sandbox's mounts: git repositories cloned into it at create and kept fresh, and
buckets (S3, GCS) mounted as file systems in the guest."""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from typing import Literal, Protocol, TypeVar
from urllib.parse import urlsplit

from pydantic import BaseModel, Field, field_validator

MAX_MOUNTS = 8  # per sandbox: each is a clone at create and a refresh loop while it runs
MOUNT_ID = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"
REF_NAME = re.compile(r"^[A-Za-z0-9._/-]{1,255}$")


class GitRef(BaseModel):
    """A branch or a tag of the repository (none: its default branch)."""

    model_config = {"extra": "forbid", "from_attributes": True}

    type: Literal["branch", "tag"]
    name: str = Field(min_length=1, max_length=255)

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        # git's own rules, narrowed: no option-like or relative names reach git's argv
        if not REF_NAME.match(value) or value.startswith(("-", "/")) or ".." in value:
            raise ValueError(f"invalid ref name {value!r}")
        if value.endswith(("/", ".lock", ".")) or "//" in value:
            raise ValueError(f"invalid ref name {value!r}")
        return value

    @property
    def refspec(self) -> str:
        return f"refs/{'heads' if self.type == 'branch' else 'tags'}/{self.name}"


class GitMount(BaseModel):
    """A git repository cloned into `path` when the sandbox is created, through the
    sandbox's egress (its rules and header secrets apply, so a private repository is
    reached with a header rule whose secret the guest never sees), and fetched and reset to
    `ref` every `refresh_interval_seconds` while the sandbox runs."""

    model_config = {"extra": "forbid", "from_attributes": True}

    id: str = Field(pattern=MOUNT_ID)
    path: str = Field(min_length=2, max_length=4096, description="absolute path in the guest")
    url: str = Field(min_length=9, max_length=2048, description="https:// URL, no credentials")
    ref: GitRef | None = None
    refresh_interval_seconds: int | None = Field(
        default=None, ge=1, le=86400, description="none: cloned once, refreshed on request"
    )

    @field_validator("path")
    @classmethod
    def _path(cls, value: str) -> str:
        return mount_path(value)

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        if any(c.isspace() or c == "\x00" for c in value):
            raise ValueError("url must not contain whitespace or NUL bytes")
        parts = urlsplit(value)
        if parts.scheme not in ("https", "http") or not parts.hostname:
            raise ValueError("url must be an absolute https:// (or http://) URL")
        if parts.username or parts.password:
            raise ValueError("url must not include credentials (use a header rule)")
        if parts.path in ("", "/") or parts.query or parts.fragment:
            raise ValueError("url must name a repository path, without query or fragment")
        return value


def mount_path(value: str) -> str:
    parts = value.split("/")
    if not value.startswith("/") or "\x00" in value or ".." in parts or value == "/":
        raise ValueError(f"mount path must be absolute, without '..': {value!r}")
    return value.rstrip("/")


class MountRefresh(BaseModel):
    """One mount's refresh: the commit it is at now."""

    id: str
    commit: str


class MountRefreshList(BaseModel):
    mounts: list[MountRefresh]


class Mounted(Protocol):
    @property
    def id(self) -> str: ...
    @property
    def path(self) -> str: ...


M = TypeVar("M", bound=Mounted)


def check_mounts(mounts: Sequence[M]) -> list[M]:
    """Ids and paths are unique, and no mount sits inside another (git and bucket mounts
    alike)."""
    ids = [m.id for m in mounts]
    if len(set(ids)) != len(ids):
        raise ValueError("mount ids must be unique")
    paths = sorted(m.path + "/" for m in mounts)
    for a, b in itertools.pairwise(paths):
        if b.startswith(a):
            raise ValueError(f"mount paths overlap: {a[:-1]} and {b[:-1]}")
    return list(mounts)
