"""Files in a sandbox: content up and down (streamed), listings and bounded walks, metadata,
moves and owners, tar archives."""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import StreamingResponse

from cella.models import (
    MAX_WALK_DEPTH,
    MAX_WALK_ENTRIES,
    ChmodRequest,
    ChownRequest,
    FileEntry,
    FileWalk,
    GuestPath,
    MkdirRequest,
    MoveRequest,
    WalkEntry,
)
from cella.server.deps import Auth, DaemonDep

router = APIRouter(prefix="/v1/sandboxes/{sandbox_id}/files", tags=["files"])

PathQ = Annotated[GuestPath, Query()]
BINARY: dict[str, Any] = {
    "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}
}
BINARY_BODY: dict[str, Any] = {"requestBody": {"required": True, **BINARY}}
BINARY_RESPONSE: dict[int | str, dict[str, Any]] = {200: BINARY}


def _declared(request: Request) -> int | None:
    length = request.headers.get("content-length")
    return int(length) if length is not None and length.isdigit() else None


@router.get("/content", response_class=StreamingResponse, responses=BINARY_RESPONSE)
async def read_file(sandbox_id: str, path: PathQ, svc: DaemonDep, who: Auth) -> StreamingResponse:
    """Downloads a file, streamed."""
    body = await svc.files.read(who, sandbox_id, path)
    return StreamingResponse(body, media_type="application/octet-stream")


@router.put("/content", response_model=FileEntry, openapi_extra=BINARY_BODY)
async def write_file(
    sandbox_id: str,
    path: PathQ,
    request: Request,
    svc: DaemonDep,
    who: Auth,
    mode: Annotated[int, Query(ge=0, le=0o7777)] = 0o644,
    parents: bool = False,
) -> FileEntry:
    """Uploads a file (atomically replaced in the guest); the body is the content."""
    entry = await svc.files.write(
        who,
        sandbox_id,
        path,
        request.stream(),
        mode=mode,
        parents=parents,
        declared=_declared(request),
    )
    return FileEntry.model_validate(entry)


@router.get("/list", response_model=list[FileEntry])
async def list_dir(sandbox_id: str, path: PathQ, svc: DaemonDep, who: Auth) -> list[FileEntry]:
    entries = await svc.files.list(who, sandbox_id, path)
    return [FileEntry.model_validate(e) for e in entries]


@router.get("/stat", response_model=FileEntry)
async def stat(sandbox_id: str, path: PathQ, svc: DaemonDep, who: Auth) -> FileEntry:
    return FileEntry.model_validate(await svc.files.stat(who, sandbox_id, path))


@router.get("/walk", response_model=FileWalk)
async def walk(
    sandbox_id: str,
    path: PathQ,
    svc: DaemonDep,
    who: Auth,
    depth: Annotated[int | None, Query(ge=1, le=MAX_WALK_DEPTH)] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_WALK_ENTRIES)] = MAX_WALK_ENTRIES,
) -> FileWalk:
    """The entries under a directory, breadth first: `depth` levels down (without it, as deep
    as the bound) and at most `limit` of them. Links are listed, never followed.
    `truncated` says a bound ended the walk before the tree did."""
    tree = svc.files.walk(who, sandbox_id, path, depth=depth, limit=limit)
    entries = [
        WalkEntry.model_validate({**asdict(found.entry), "path": found.path})
        async for found in tree
    ]
    return FileWalk(entries=entries, truncated=tree.truncated)


@router.post("/move", response_model=FileEntry)
async def move(sandbox_id: str, body: MoveRequest, svc: DaemonDep, who: Auth) -> FileEntry:
    """Renames a file or directory; a file at the destination is replaced. The moved entry."""
    entry = await svc.files.move(who, sandbox_id, body.source, body.destination)
    return FileEntry.model_validate(entry)


@router.post("/chown", status_code=204)
async def chown(sandbox_id: str, body: ChownRequest, svc: DaemonDep, who: Auth) -> Response:
    """Gives a path (`recursive`: and all below it) to a user and group (without a group, the
    user's login group)."""
    await svc.files.chown(
        who, sandbox_id, body.path, body.user, body.group, recursive=body.recursive
    )
    return Response(status_code=204)


@router.post("/mkdir", status_code=204)
async def mkdir(sandbox_id: str, body: MkdirRequest, svc: DaemonDep, who: Auth) -> Response:
    await svc.files.mkdir(who, sandbox_id, body.path, mode=body.mode, parents=body.parents)
    return Response(status_code=204)


@router.post("/chmod", status_code=204)
async def chmod(sandbox_id: str, body: ChmodRequest, svc: DaemonDep, who: Auth) -> Response:
    await svc.files.chmod(who, sandbox_id, body.path, body.mode)
    return Response(status_code=204)


@router.delete("", status_code=204)
async def remove(
    sandbox_id: str, path: PathQ, svc: DaemonDep, who: Auth, recursive: bool = False
) -> Response:
    await svc.files.remove(who, sandbox_id, path, recursive=recursive)
    return Response(status_code=204)


@router.get("/archive", response_class=StreamingResponse, responses=BINARY_RESPONSE)
async def download_archive(
    sandbox_id: str, path: PathQ, svc: DaemonDep, who: Auth
) -> StreamingResponse:
    """Downloads a directory as an uncompressed tar archive, streamed."""
    body = await svc.files.download_archive(who, sandbox_id, path)
    return StreamingResponse(body, media_type="application/x-tar")


@router.put("/archive", status_code=204, openapi_extra=BINARY_BODY)
async def upload_archive(
    sandbox_id: str, path: PathQ, request: Request, svc: DaemonDep, who: Auth
) -> Response:
    """Unpacks a tar archive (the body) into a directory, creating it if needed."""
    await svc.files.upload_archive(
        who, sandbox_id, path, request.stream(), declared=_declared(request)
    )
    return Response(status_code=204)
