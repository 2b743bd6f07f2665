"""Checkpoints of a sandbox, the file changes between two of them, and the patch of those
changes that `git apply` takes."""

from __future__ import annotations

import posixpath
from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field

CheckpointName = str
NOW = "now"  # in a diff: the sandbox as it is


class CheckpointCreate(BaseModel):
    model_config = {"extra": "forbid"}

    name: str | None = Field(
        default=None,
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
        description="unique among the sandbox's checkpoints; default `cp-<n>`",
    )


class Checkpoint(BaseModel):
    id: str = Field(description="the snapshot that holds it")
    name: str
    sandbox_id: str
    size_bytes: int | None = None
    paused_ms: float | None = Field(default=None, description="how long the sandbox paused")
    created_at: datetime


class CheckpointList(BaseModel):
    checkpoints: list[Checkpoint]


class FileChange(BaseModel):
    path: str
    change: Literal["added", "removed", "modified"]
    kind: Literal["file", "dir", "symlink", "other"]
    size: int | None = Field(default=None, description="after (None: removed)")
    old_size: int | None = Field(default=None, description="before (None: added)")
    mode: int | None = Field(default=None, description="permission bits after")
    old_mode: int | None = Field(default=None, description="permission bits before")
    diff: str | None = Field(default=None, description="unified diff of a text file's content")
    binary: bool = False
    too_large: bool = Field(default=False, description="past the bound: no diff")


class CheckpointDiff(BaseModel):
    sandbox_id: str
    a: str = Field(description="the checkpoint it starts from")
    b: str = Field(description="the checkpoint it goes to, or `now`")
    changes: list[FileChange]
    truncated: bool = Field(default=False, description="more paths changed than are listed")

    def under(self, path_prefix: str) -> list[FileChange]:
        prefix = _prefix(path_prefix)
        return [c for c in self.changes if c.path.startswith(prefix)]

    def patch(self, path_prefix: str = "/") -> str:
        """The text changes under `path_prefix` as a patch `git apply` takes in a checkout
        of that directory (paths relative to it; `.git` left out; binary files and files
        past the bound are not in it)."""
        prefix = _prefix(path_prefix)
        out: list[str] = []
        for c in self.under(path_prefix):
            rel = c.path[len(prefix) :]
            if c.kind != "file" or c.diff is None or ".git" in rel.split("/"):
                continue
            mode_old = f"100{(c.old_mode or 0o644) & 0o777:o}"
            mode_new = f"100{(c.mode or 0o644) & 0o777:o}"
            out.append(f"diff --git a/{rel} b/{rel}\n")
            if c.change == "added":
                out.append(f"new file mode {_git_mode(mode_new)}\n")
            elif c.change == "removed":
                out.append(f"deleted file mode {_git_mode(mode_old)}\n")
            elif _git_mode(mode_old) != _git_mode(mode_new):
                out.append(f"old mode {_git_mode(mode_old)}\nnew mode {_git_mode(mode_new)}\n")
            body = c.diff.split("\n", 2)[2] if c.diff.count("\n") >= 2 else ""
            if body:
                old = "/dev/null" if c.change == "added" else f"a/{rel}"
                new = "/dev/null" if c.change == "removed" else f"b/{rel}"
                out.append(f"--- {old}\n+++ {new}\n{body}")
        return "".join(out)


def _prefix(path: str) -> str:
    return posixpath.normpath("/" + path.strip("/")).rstrip("/") + "/"


def _git_mode(mode: str) -> str:
    """git knows two modes of a file: executable or not."""
    return "100755" if int(mode, 8) & 0o111 else "100644"


class RewindRequest(BaseModel):
    model_config = {"extra": "forbid"}

    checkpoint: str = Field(min_length=1, max_length=128, description="its name or id")
