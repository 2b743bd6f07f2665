"""File system entries and file requests."""

from __future__ import annotations

import posixpath
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, Field


def guest_path(path: str) -> str:
    """Absolute, normalised, free of NUL bytes. The path is inside the guest's own file
    system, so `..` cannot reach the host; it is normalised so errors name the real path."""
    if "\x00" in path:
        raise ValueError("path must not contain NUL bytes")
    if not path.startswith("/"):
        raise ValueError(f"path must be absolute: {path!r}")
    return posixpath.normpath(path).replace("//", "/")


GuestPath = Annotated[
    str,
    Field(min_length=1, max_length=4096, description="absolute guest path"),
    AfterValidator(guest_path),
]


class FileEntry(BaseModel):
    model_config = {"from_attributes": True}

    name: str
    kind: Literal["file", "dir", "symlink", "other"]
    mode: int
    size: int
    mtime_ns: int
    uid: int
    gid: int
    target: str | None = None


class MkdirRequest(BaseModel):
    model_config = {"extra": "forbid"}

    path: GuestPath
    parents: bool = False
    mode: int = Field(default=0o755, ge=0, le=0o7777)


class ChmodRequest(BaseModel):
    model_config = {"extra": "forbid"}

    path: GuestPath
    mode: int = Field(ge=0, le=0o7777)
