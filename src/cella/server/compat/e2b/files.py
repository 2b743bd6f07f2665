"""envd's `/files`: a file read, streamed, and files written (multipart parts, or one
octet-stream body, gzip allowed), each made, with any directory above it, as the user the
SDK acts as, with the metadata of the request's `X-Metadata-<key>` headers (kept as the
file's `user.e2b.<key>` extended attributes; an upload replaces them all). Either call may
come from a signed URL instead of with the access token (`target.check_signature`)."""

from __future__ import annotations

import posixpath
import re
import zlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from cella import errors
from cella.server.compat.e2b.target import Target, first_missing, own, target

METADATA_HEADER = "x-metadata-"
XATTR_PREFIX = "user.e2b."
PRINTABLE = re.compile(r"\A[\x20-\x7e]*\Z")
MAX_METADATA_KEY, MAX_METADATA = 246, 4096
router = APIRouter(include_in_schema=False)


@router.get("/files")
async def read_file(request: Request, path: str, username: str | None = None) -> Response:
    where = await target(request, username, signed="read")
    chunks = await where.svc.files.read(where.who, where.sandbox_id, where.path(path))
    return StreamingResponse(chunks, media_type="application/octet-stream")


@router.post("/files")
async def write_files(
    request: Request, path: str | None = None, username: str | None = None
) -> list[dict[str, Any]]:
    where = await target(request, username, signed="write")
    metadata = metadata_of(request)
    kind = request.headers.get("content-type", "")
    written = []
    if kind.startswith("multipart/form-data"):
        form = await request.form()
        for item in form.getlist("file"):
            if isinstance(item, str):
                raise errors.InvalidArgument("a `file` part without a file")
            dest = where.path(path or item.filename)
            written.append(await _write(where, dest, _upload(item), metadata))
    else:
        dest = where.path(path)
        body: AsyncIterator[bytes] = request.stream()
        if request.headers.get("content-encoding", "").lower() == "gzip":
            body = _gunzip(body)
        written.append(await _write(where, dest, body, metadata))
    if not written:
        raise errors.InvalidArgument("no file in the request")
    return written


def metadata_of(request: Request) -> dict[str, str]:
    """The `X-Metadata-<key>` headers as metadata (keys lower-cased, the first of a repeated
    key kept), held to envd's bounds: printable ASCII, keys of at most 246 bytes, all of it
    (with the attribute prefix counted per key) at most 4096."""
    found: dict[str, str] = {}
    for name, value in request.headers.items():
        if not name.lower().startswith(METADATA_HEADER):
            continue
        key = name[len(METADATA_HEADER) :].lower()
        if not key or not PRINTABLE.match(key) or not PRINTABLE.match(value):
            raise errors.InvalidArgument(f"metadata {key!r}: keys and values are printable ASCII")
        if len(key) > MAX_METADATA_KEY:
            raise errors.InvalidArgument(f"metadata key {key!r} is over {MAX_METADATA_KEY} bytes")
        found.setdefault(key, value)
    size = sum(len(XATTR_PREFIX) + len(k) + len(v) for k, v in found.items())
    if size > MAX_METADATA:
        raise errors.InvalidArgument(f"metadata of {size} bytes: at most {MAX_METADATA}")
    return found


async def _write(
    where: Target, path: str, body: AsyncIterator[bytes], metadata: dict[str, str]
) -> dict[str, Any]:
    top = await first_missing(where, path)
    files = where.svc.files
    await files.write(where.who, where.sandbox_id, path, body, parents=True, metadata=metadata)
    await own(where, top)
    written: dict[str, Any] = {"name": posixpath.basename(path), "type": "file", "path": path}
    if metadata:
        written["metadata"] = metadata
    return written


async def _upload(item: Any) -> AsyncIterator[bytes]:
    while chunk := await item.read(256 << 10):
        yield chunk


async def _gunzip(body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        async for chunk in body:
            if out := inflate.decompress(chunk):
                yield out
        if rest := inflate.flush():
            yield rest
    except zlib.error:
        raise errors.InvalidArgument("the body is not valid gzip") from None
