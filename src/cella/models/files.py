"""File system entries and file requests."""

from __future__ import annotations

import posixpath
import re
from datetime import datetime
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


class MoveRequest(BaseModel):
    model_config = {"extra": "forbid"}

    source: GuestPath
    destination: GuestPath = Field(description="the new path; an existing file there is replaced")


# A user or group as `chown` takes it: a name of the portable set (letters, digits, `_`,
# `.`, `-`, not leading; Samba's trailing `$`) or a numeric id. Nothing else reaches a
# command line in the guest.
ACCOUNT_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,31}\$?$"


def account_name(name: str) -> str:
    if not re.fullmatch(ACCOUNT_PATTERN, name):
        raise ValueError(f"{name!r} is not a user or group name")
    return name


AccountName = Annotated[str, Field(pattern=ACCOUNT_PATTERN)]


class ChownRequest(BaseModel):
    model_config = {"extra": "forbid"}

    path: GuestPath
    user: AccountName = Field(description="the new owner: a user name or a numeric id")
    group: AccountName | None = Field(
        default=None, description="the new group; without it, the user's login group"
    )
    recursive: bool = False


# The bounds of a walk (`/files/walk`, and every recursive listing the adapters make): how
# many levels below the root it descends and how many entries it reports.
MAX_WALK_DEPTH = 64
MAX_WALK_ENTRIES = 20_000


class WalkEntry(FileEntry):
    path: str = Field(description="absolute guest path")


class FileWalk(BaseModel):
    """Entries under a directory, breadth first (each directory's in name order)."""

    entries: list[WalkEntry]
    truncated: bool = Field(
        description="a bound (depth, entries) ended the walk before the tree did"
    )


class DownloadUrlRequest(BaseModel):
    model_config = {"extra": "forbid"}

    path: GuestPath
    expires_in_seconds: int | None = Field(
        default=3600, ge=1, le=365 * 86400, description="null: a link that never expires"
    )
    content_type: str | None = Field(
        default=None, max_length=200, description="served as; guessed from the name if left out"
    )
    content_disposition: Literal["attachment", "inline"] = "attachment"


class DownloadUrl(BaseModel):
    url: str = Field(description="GET (or HEAD, with Range) it without a key")
    token: str = Field(description="the signed token the URL carries")
    path: str
    expires_at: datetime | None = Field(description="null: it never expires")
