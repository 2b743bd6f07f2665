"""File system entries and file requests."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class FileEntry(BaseModel):
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

    path: str = Field(min_length=1, max_length=4096)
    parents: bool = False
    mode: int = Field(default=0o755, ge=0, le=0o7777)


class ChmodRequest(BaseModel):
    model_config = {"extra": "forbid"}

    path: str = Field(min_length=1, max_length=4096)
    mode: int = Field(ge=0, le=0o7777)
