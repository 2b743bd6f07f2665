"""E2B's volumes onto cella's (`service/volumes.py`): the team's volumes (`/volumes`, the
API key) and the volume content API (`/volumecontent/{volumeID}/...`, the volume's own
token as a bearer, served at the same address: the SDK's `E2B_VOLUME_API_URL` or
`api_url` is E2B_API_URL's). A volume is deleted whether sandboxes mount it or not, as
E2B's API does (its spec has no refusal). File owners are not kept (every file is root's
in a guest): a `uid` or `gid` is refused by name; `mode` is kept."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Body, Header, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from cella import errors
from cella.models.volumes import VOLUME_NAME
from cella.server.compat.e2b.shapes import iso
from cella.server.deps import Caller, DaemonDep
from cella.service.daemon import Daemon
from cella.service.volumes import Entry, VolumeRecord

Json = dict[str, Any]
router = APIRouter(include_in_schema=False)
CONTENT = "/volumecontent/{volume_id}"


@router.post("/volumes", status_code=201)
async def create(svc: DaemonDep, who: Caller, body: Annotated[Json, Body()]) -> Json:
    name = body.get("name")
    if not isinstance(name, str) or not re.match(VOLUME_NAME, name):
        raise errors.InvalidArgument("Invalid volume name (letters, digits, '_' and '-')")
    try:
        made = svc.volumes.create(who, name)
    except errors.AlreadyExists:
        raise errors.InvalidArgument(f"Volume with name '{name}' already exists") from None
    return _with_token(svc, made.id, made.name)


@router.get("/volumes")
async def list_volumes(svc: DaemonDep, who: Caller) -> list[Json]:
    return [{"volumeID": v.id, "name": v.name} for v in svc.volumes.find(who).volumes]


@router.get("/volumes/{volume_id}")
async def get(volume_id: str, svc: DaemonDep, who: Caller) -> Json:
    found = svc.volumes.get(who, volume_id)
    return _with_token(svc, found.id, found.name)


@router.delete("/volumes/{volume_id}", status_code=204)
async def delete(volume_id: str, svc: DaemonDep, who: Caller) -> Response:
    svc.volumes.delete(who, volume_id, force=True)
    return Response(status_code=204)


def _with_token(svc: Daemon, volume_id: str, name: str) -> Json:
    return {"volumeID": volume_id, "name": name, "token": svc.volumes.ports.volume_token(volume_id)}


# -- content, with the volume's token ----------------------------------------------------


def _volume(svc: Daemon, volume_id: str, authorization: str | None) -> VolumeRecord:
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise errors.Unauthenticated("the volume's token is required (Authorization: Bearer)")
    _, record = svc.volumes.by_token(volume_id, token.strip())
    return record


def _owners(request: Request) -> None:
    for name in ("uid", "gid"):
        if request.query_params.get(name) not in (None, ""):
            raise errors.InvalidArgument(f"not supported by cella: {name} (volume files' owners)")


def _mode(request: Request) -> int | None:
    raw = request.query_params.get("mode")
    if raw in (None, ""):
        return None
    try:
        mode = int(raw)
    except ValueError:
        raise errors.InvalidArgument("mode must be an integer") from None
    if not 0 <= mode <= 0o7777:
        raise errors.InvalidArgument("mode must be 0-07777")
    return mode


def _flag(request: Request, name: str) -> bool:
    return (request.query_params.get(name) or "").lower() == "true"


def _path(request: Request) -> str:
    path = request.query_params.get("path")
    if not path:
        raise errors.InvalidArgument("path is required")
    return path


def stat_json(entry: Entry) -> Json:
    def at(t: float) -> str:
        return iso(datetime.fromtimestamp(t).astimezone())

    return {
        "name": entry.name,
        "type": "directory" if entry.is_dir else "file",
        "path": entry.path,
        "size": entry.size,
        "mode": entry.mode,
        "uid": 0,
        "gid": 0,
        "atime": at(entry.atime),
        "mtime": at(entry.mtime),
        "ctime": at(entry.ctime),
    }


Bearer = Annotated[str | None, Header(alias="authorization")]


@router.get(CONTENT + "/dir")
async def list_dir(volume_id: str, request: Request, svc: DaemonDep, auth: Bearer = None) -> Any:
    record = _volume(svc, volume_id, auth)
    raw = request.query_params.get("depth") or "1"
    if not raw.isdigit() or not 1 <= int(raw) <= 16:
        raise errors.InvalidArgument("depth must be 1-16")
    entries = svc.volumes.listing(record, _path(request), int(raw))
    return [stat_json(e) for e in entries]


@router.post(CONTENT + "/dir", status_code=201)
async def make_dir(volume_id: str, request: Request, svc: DaemonDep, auth: Bearer = None) -> Json:
    record = _volume(svc, volume_id, auth)
    _owners(request)
    made = svc.volumes.mkdir(record, _path(request), _flag(request, "force"), _mode(request))
    return stat_json(made)


@router.get(CONTENT + "/file")
async def read_file(
    volume_id: str, request: Request, svc: DaemonDep, auth: Bearer = None
) -> StreamingResponse:
    record = _volume(svc, volume_id, auth)
    body = await svc.volumes.read(record, _path(request))
    return StreamingResponse(body, media_type="application/octet-stream")


@router.put(CONTENT + "/file", status_code=201)
async def write_file(volume_id: str, request: Request, svc: DaemonDep, auth: Bearer = None) -> Json:
    """Without `force`, a file that exists is not replaced and its directory must exist
    (E2B's orchestrator opens it with O_EXCL); with it, parents are made and it is."""
    record = _volume(svc, volume_id, auth)
    _owners(request)
    path, force = _path(request), _flag(request, "force")
    if not force:
        try:
            svc.volumes.stat(record, path)
        except errors.NotFound:
            pass
        else:
            raise errors.AlreadyExists(f"{path}: exists (write it with force to replace it)")
    entry = await svc.volumes.write(record, path, request.stream(), force, _mode(request))
    return stat_json(entry)


@router.get(CONTENT + "/path")
async def stat(volume_id: str, request: Request, svc: DaemonDep, auth: Bearer = None) -> Json:
    record = _volume(svc, volume_id, auth)
    return stat_json(svc.volumes.stat(record, _path(request)))


@router.delete(CONTENT + "/path", status_code=204)
async def remove(volume_id: str, request: Request, svc: DaemonDep, auth: Bearer = None) -> Response:
    record = _volume(svc, volume_id, auth)
    svc.volumes.remove(record, _path(request))
    return Response(status_code=204)


@router.patch(CONTENT + "/path")
async def update(
    volume_id: str,
    request: Request,
    svc: DaemonDep,
    auth: Bearer = None,
    body: Annotated[Json | None, Body()] = None,
) -> JSONResponse:
    record = _volume(svc, volume_id, auth)
    body = body or {}
    if body.get("uid") is not None or body.get("gid") is not None:
        raise errors.InvalidArgument("not supported by cella: uid, gid (volume files' owners)")
    path = _path(request)
    mode = body.get("mode")
    if mode is None:
        return JSONResponse(stat_json(svc.volumes.stat(record, path)))
    if not isinstance(mode, int) or not 0 <= mode <= 0o7777:
        raise errors.InvalidArgument("mode must be an integer 0-07777")
    return JSONResponse(stat_json(svc.volumes.chmod(record, path, mode)))
