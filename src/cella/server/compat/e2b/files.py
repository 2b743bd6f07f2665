"""envd's `/files`: a file read, streamed, and files written (multipart parts, or one
octet-stream body, gzip allowed), each made, with any directory above it, as the user the
SDK acts as."""

from __future__ import annotations

import posixpath
import zlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from cella import errors
from cella.server.compat.e2b.target import Target, first_missing, own, target

router = APIRouter(include_in_schema=False)


@router.get("/files")
async def read_file(request: Request, path: str, username: str | None = None) -> Response:
    where = await target(request, username)
    chunks = await where.svc.files.read(where.who, where.sandbox_id, where.path(path))
    return StreamingResponse(chunks, media_type="application/octet-stream")


@router.post("/files")
async def write_files(
    request: Request, path: str | None = None, username: str | None = None
) -> list[dict[str, str]]:
    where = await target(request, username)
    kind = request.headers.get("content-type", "")
    written = []
    if kind.startswith("multipart/form-data"):
        form = await request.form()
        for item in form.getlist("file"):
            if isinstance(item, str):
                raise errors.InvalidArgument("a `file` part without a file")
            dest = where.path(path or item.filename)
            written.append(await _write(where, dest, _upload(item)))
    else:
        dest = where.path(path)
        body: AsyncIterator[bytes] = request.stream()
        if request.headers.get("content-encoding", "").lower() == "gzip":
            body = _gunzip(body)
        written.append(await _write(where, dest, body))
    if not written:
        raise errors.InvalidArgument("no file in the request")
    return written


async def _write(where: Target, path: str, body: AsyncIterator[bytes]) -> dict[str, str]:
    top = await first_missing(where, path)
    await where.svc.files.write(where.who, where.sandbox_id, path, body, parents=True)
    await own(where, top)
    return {"name": posixpath.basename(path), "type": "file", "path": path}


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
