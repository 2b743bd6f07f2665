"""Download links: a URL that fetches one file of one sandbox without an API key. The link
carries a JWT signed with the daemon's signing key (`signing.Signer`) naming the sandbox,
the exact path, the headers to serve it with and (unless it never expires) when it
expires; the path is in the URL too, and must be the one signed. Whoever holds the link
reads that file and nothing else; a link made `wake` resumes a stopped sandbox to serve
it, as LangSmith's do."""

from __future__ import annotations

import mimetypes
import posixpath
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Literal
from urllib.parse import quote

from cella import errors
from cella.policy.access import Permission, Principal
from cella.service.files import Files
from cella.service.lifecycle import Lifecycle
from cella.service.registry import Registry
from cella.service.signing import Signer

AUDIENCE = "cella:download"
_TOKEN = r"[A-Za-z0-9!#$&^_.+-]+"
# a media type and its parameters: what a Content-Type header may carry, nothing else
MEDIA_TYPE = re.compile(rf'{_TOKEN}/{_TOKEN}( *; *{_TOKEN}=({_TOKEN}|"[ !#-\[\]-~]*"))*')
MAX_LINK_SECONDS = 365 * 86400
Disposition = Literal["attachment", "inline"]


@dataclass(frozen=True, slots=True)
class DownloadLink:
    token: str
    sandbox_id: str
    path: str
    expires_at: float | None  # None: it never expires


@dataclass(frozen=True, slots=True)
class LinkClaims:
    tenant: str
    sandbox_id: str
    path: str
    content_type: str
    disposition: Disposition
    wake: bool


@dataclass(slots=True)
class Download:
    content_type: str
    disposition: str  # the Content-Disposition header's value
    size: int
    first: int  # the bytes served: first..last, both included
    last: int
    partial: bool  # a Range was asked for and is served
    body: AsyncGenerator[bytes, None]


class Downloads:
    def __init__(
        self, registry: Registry, files: Files, lifecycle: Lifecycle, signer: Signer
    ) -> None:
        self.registry = registry
        self.files = files
        self.lifecycle = lifecycle
        self.signer = signer

    def mint(
        self,
        who: Principal,
        sandbox_id: str,
        path: str,
        seconds: int | None,
        *,
        content_type: str | None = None,
        disposition: Disposition = "attachment",
        wake: bool = False,
    ) -> DownloadLink:
        # a link reads as its maker may (and wakes the sandbox only if they may)
        need = Permission.exec if wake else Permission.view
        tenant = self.registry.get(who, sandbox_id, need).tenant
        if not path.startswith("/") or path == "/" or posixpath.normpath(path) != path:
            raise errors.InvalidArgument(f"a link names one file by its absolute path: {path!r}")
        if seconds is not None and not 1 <= seconds <= MAX_LINK_SECONDS:
            raise errors.InvalidArgument(f"a link lasts 1-{MAX_LINK_SECONDS} seconds")
        if content_type is not None and not MEDIA_TYPE.fullmatch(content_type):
            raise errors.InvalidArgument(f"not a media type: {content_type!r}")
        if disposition not in ("attachment", "inline"):
            raise errors.InvalidArgument("content_disposition is 'attachment' or 'inline'")
        now = int(time.time())
        claims: dict[str, object] = {
            "aud": AUDIENCE,
            "sub": sandbox_id,
            "ten": tenant,
            "path": path,
            "ct": content_type or guess_type(path),
            "cd": disposition,
            "wake": wake,
            "iat": now,
        }
        if seconds is not None:
            claims["exp"] = now + seconds
        token = self.signer.sign(claims)
        return DownloadLink(token, sandbox_id, path, None if seconds is None else now + seconds)

    def check(self, token: str, sandbox_id: str, path: str) -> LinkClaims:
        """The link's claims if it is ours, unexpired, and for this sandbox and path."""
        claims = self.signer.verify(token, audience=AUDIENCE, required=["sub", "path"])
        if claims["sub"] != sandbox_id or claims["path"] != path:
            raise errors.PermissionDenied("this link is for another file")
        return LinkClaims(
            str(claims["ten"]),
            sandbox_id,
            path,
            str(claims["ct"]),
            "inline" if claims.get("cd") == "inline" else "attachment",
            bool(claims.get("wake")),
        )

    async def open(self, link: LinkClaims, ranged: str | None, *, head: bool = False) -> Download:
        """The file a link names (`ranged`: a `Range` header; one range is served, any
        other form gets the whole file); with `head`, its headers and no body. The link
        is the holder's right to the file: it acts for the tenant."""
        holder = Principal.service(link.tenant)
        if link.wake:
            await self.lifecycle.awake(holder, link.sandbox_id)
        entry = await self.files.stat(holder, link.sandbox_id, link.path)
        if entry.kind == "dir":
            raise errors.IsADirectory(f"{link.path} is a directory")
        span = byte_range(ranged, entry.size)
        first, last = span if span else (0, entry.size - 1)
        body = _nothing() if head else await self.files.read(holder, link.sandbox_id, link.path)
        return Download(
            link.content_type,
            content_disposition(link.disposition, posixpath.basename(link.path)),
            entry.size,
            first,
            last,
            span is not None,
            _slice(body, first, last),
        )


def guess_type(path: str) -> str:
    return mimetypes.guess_type(path)[0] or "application/octet-stream"


def content_disposition(kind: str, name: str) -> str:
    """`attachment; filename="…"` with an ASCII fallback and the exact name (RFC 6266)."""
    ascii_name = "".join(c if 32 <= ord(c) < 127 and c not in '"\\' else "_" for c in name)
    return f"{kind}; filename=\"{ascii_name}\"; filename*=UTF-8''{quote(name, safe='')}"


def byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """One satisfiable `bytes=` range of a file of `size` bytes, or None (serve it all).
    An unsatisfiable one is `RangeNotSatisfiable`."""
    if not header or not header.startswith("bytes=") or "," in header:
        return None
    first_s, dash, last_s = header[6:].strip().partition("-")
    if not dash or not (first_s.isdigit() or last_s.isdigit()):
        return None
    if not first_s:  # the last N bytes
        if int(last_s) == 0:
            raise errors.RangeNotSatisfiable(f"bytes */{size}")
        return max(0, size - int(last_s)), size - 1
    first = int(first_s)
    last = min(int(last_s), size - 1) if last_s.isdigit() else size - 1
    if first >= size or last < first:
        raise errors.RangeNotSatisfiable(f"bytes */{size}")
    return first, last


async def _nothing() -> AsyncIterator[bytes]:
    return
    yield


async def _slice(body: AsyncIterator[bytes], first: int, last: int) -> AsyncGenerator[bytes, None]:
    """Bytes first..last of a stream (the guest sends the file from its start)."""
    at = 0
    try:
        async for chunk in body:
            start, end = max(first - at, 0), min(last + 1 - at, len(chunk))
            if start < end:
                yield chunk[start:end]
            at += len(chunk)
            if at > last:
                break
    finally:
        close = getattr(body, "aclose", None)
        if close is not None:
            await close()
