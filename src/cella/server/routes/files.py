"""Files in a sandbox: content up and down (streamed), listings, metadata, tar archives."""

from __future__ import annotations

import hashlib
import posixpath
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import StreamingResponse

from cella import errors
from cella.models import ChmodRequest, FileEntry, MkdirRequest
from cella.server.app import Auth
from cella.server.routes._deps import service

router = APIRouter(prefix="/v1/sandboxes/{sandbox_id}/files", tags=["files"])

PathQ = Annotated[str, Query(min_length=1, max_length=4096, description="absolute guest path")]
BINARY_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
    }
}
BINARY_RESPONSE: dict[int | str, dict[str, Any]] = {
    200: {
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}
    }
}


def guest_path(path: str) -> str:
    """Absolute, normalised, free of NUL bytes. The path is inside the guest's own file
    system, so `..` cannot reach the host; it is normalised so errors name the real path."""
    if "\x00" in path:
        raise errors.InvalidArgument("path must not contain NUL bytes")
    if not path.startswith("/"):
        raise errors.InvalidArgument(f"path must be absolute: {path!r}")
    return posixpath.normpath(path).replace("//", "/")


async def _body(request: Request, limit: int) -> AsyncIterator[bytes]:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise errors.PayloadTooLarge(f"upload of {declared} bytes exceeds {limit}")
    seen = 0
    async for chunk in request.stream():
        seen += len(chunk)
        if seen > limit:
            raise errors.PayloadTooLarge(f"upload exceeds {limit} bytes")
        yield chunk


async def _hashed(stream: AsyncIterator[bytes], digest: Any) -> AsyncIterator[bytes]:
    async for chunk in stream:
        digest.update(chunk)
        yield chunk


async def _primed(stream: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Pulls the first chunk before the response starts, so errors become 4xx, not a cut."""
    first = await anext(stream, b"")

    async def rest() -> AsyncIterator[bytes]:
        if first:
            yield first
        async for chunk in stream:
            yield chunk

    return rest()


@router.get("/content", response_class=StreamingResponse, responses=BINARY_RESPONSE)
async def read_file(sandbox_id: str, path: PathQ, request: Request, who: Auth) -> StreamingResponse:
    """Downloads a file, streamed."""
    vm = service(request).vm(who.tenant, sandbox_id)
    body = await _primed(vm.agent.read_stream(guest_path(path)))
    return StreamingResponse(body, media_type="application/octet-stream")


@router.put("/content", response_model=FileEntry, openapi_extra=BINARY_BODY)
async def write_file(
    sandbox_id: str,
    path: PathQ,
    request: Request,
    who: Auth,
    mode: Annotated[int, Query(ge=0, le=0o7777)] = 0o644,
    parents: bool = False,
) -> FileEntry:
    """Uploads a file (atomically replaced in the guest); the body is the content."""
    svc = service(request)
    vm = svc.vm(who.tenant, sandbox_id)
    target = guest_path(path)
    limit = svc.settings.max_upload_mib << 20
    digest = hashlib.sha256()
    await vm.agent.write_file(
        target, _hashed(_body(request, limit), digest), mode=mode, parents=parents
    )
    entry = await vm.agent.stat(target)
    svc.event_log.emit(
        sandbox_id,
        "file_write",
        {"path": target, "size": entry.size, "mode": mode, "sha256": digest.hexdigest()},
    )
    return FileEntry.model_validate(entry, from_attributes=True)


@router.get("/list", response_model=list[FileEntry])
async def list_dir(sandbox_id: str, path: PathQ, request: Request, who: Auth) -> list[FileEntry]:
    vm = service(request).vm(who.tenant, sandbox_id)
    entries = await vm.agent.list_dir(guest_path(path))
    return [FileEntry.model_validate(e, from_attributes=True) for e in entries]


@router.get("/stat", response_model=FileEntry)
async def stat(sandbox_id: str, path: PathQ, request: Request, who: Auth) -> FileEntry:
    vm = service(request).vm(who.tenant, sandbox_id)
    entry = await vm.agent.stat(guest_path(path))
    return FileEntry.model_validate(entry, from_attributes=True)


@router.post("/mkdir", status_code=204)
async def mkdir(sandbox_id: str, body: MkdirRequest, request: Request, who: Auth) -> Response:
    svc = service(request)
    vm = svc.vm(who.tenant, sandbox_id)
    target = guest_path(body.path)
    await vm.agent.mkdir(target, mode=body.mode, parents=body.parents)
    svc.event_log.emit(sandbox_id, "mkdir", {"path": target, "mode": body.mode})
    return Response(status_code=204)


@router.post("/chmod", status_code=204)
async def chmod(sandbox_id: str, body: ChmodRequest, request: Request, who: Auth) -> Response:
    svc = service(request)
    vm = svc.vm(who.tenant, sandbox_id)
    target = guest_path(body.path)
    await vm.agent.chmod(target, body.mode)
    svc.event_log.emit(sandbox_id, "chmod", {"path": target, "mode": body.mode})
    return Response(status_code=204)


@router.delete("", status_code=204)
async def remove(
    sandbox_id: str, path: PathQ, request: Request, who: Auth, recursive: bool = False
) -> Response:
    svc = service(request)
    vm = svc.vm(who.tenant, sandbox_id)
    target = guest_path(path)
    await vm.agent.remove(target, recursive=recursive)
    svc.event_log.emit(sandbox_id, "file_remove", {"path": target, "recursive": recursive})
    return Response(status_code=204)


@router.get("/archive", response_class=StreamingResponse, responses=BINARY_RESPONSE)
async def download_archive(
    sandbox_id: str, path: PathQ, request: Request, who: Auth
) -> StreamingResponse:
    """Downloads a directory as an uncompressed tar archive, streamed."""
    vm = service(request).vm(who.tenant, sandbox_id)
    body = await _primed(vm.agent.tar_out(guest_path(path)))
    return StreamingResponse(body, media_type="application/x-tar")


@router.put("/archive", status_code=204, openapi_extra=BINARY_BODY)
async def upload_archive(sandbox_id: str, path: PathQ, request: Request, who: Auth) -> Response:
    """Unpacks a tar archive (the body) into a directory, creating it if needed."""
    svc = service(request)
    vm = svc.vm(who.tenant, sandbox_id)
    target = guest_path(path)
    digest = hashlib.sha256()
    size = 0

    async def counted() -> AsyncIterator[bytes]:
        nonlocal size
        async for chunk in _hashed(_body(request, svc.settings.max_upload_mib << 20), digest):
            size += len(chunk)
            yield chunk

    await vm.agent.tar_in(target, counted())
    svc.event_log.emit(
        sandbox_id, "archive_upload", {"path": target, "size": size, "sha256": digest.hexdigest()}
    )
    return Response(status_code=204)
