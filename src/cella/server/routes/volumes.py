"""Volumes: a tenant's persistent file trees, mounted by sandboxes (`volume_mounts` at
create) and read and written here without any sandbox."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request, Response
from fastapi.responses import StreamingResponse

from cella.models import Volume, VolumeCreate, VolumeEntry, VolumeEntryList, VolumeList
from cella.models.volumes import VOLUME_ID, RemoteVolumeLend
from cella.server.deps import Auth, DaemonDep
from cella.service.keys import require_admin
from cella.service.volumes import RemoteVolume, entry_of

router = APIRouter(prefix="/v1/volumes", tags=["volumes"])

PathQ = Annotated[str, Query(min_length=1, max_length=4096, description="from the volume's root")]
BINARY: dict[str, Any] = {
    "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}
}


@router.post("", status_code=201, response_model=Volume)
async def create_volume(body: VolumeCreate, svc: DaemonDep, who: Auth) -> Volume:
    return svc.volumes.create(who, body.name)


@router.get("", response_model=VolumeList)
async def list_volumes(svc: DaemonDep, who: Auth) -> VolumeList:
    """The tenant's volumes, with its quota and what they hold."""
    return svc.volumes.find(who)


@router.get("/{key}", response_model=Volume)
async def get_volume(key: str, svc: DaemonDep, who: Auth) -> Volume:
    """A volume by id or name."""
    return svc.volumes.get(who, key)


@router.delete("/{key}", status_code=204)
async def delete_volume(key: str, svc: DaemonDep, who: Auth, force: bool = False) -> Response:
    """Deletes the volume and its files; one a sandbox mounts is refused (409) unless
    `force`."""
    svc.volumes.delete(who, key, force)
    return Response(status_code=204)


@router.put("/{volume_id}/remote", status_code=204, include_in_schema=False)
async def lend_volume(
    volume_id: Annotated[str, Path(pattern=VOLUME_ID)],
    body: RemoteVolumeLend,
    svc: DaemonDep,
    who: Auth,
) -> Response:
    """A volume of another node of a fleet that this node's sandboxes may mount (a fleet
    gateway's admin key)."""
    require_admin(who, "lend a volume of another node")
    svc.volumes.remote.put(RemoteVolume(volume_id, **body.model_dump()))
    return Response(status_code=204)


@router.get("/{key}/content", response_class=StreamingResponse, responses={200: BINARY})
async def read_file(key: str, path: PathQ, svc: DaemonDep, who: Auth) -> StreamingResponse:
    record = svc.volumes.record(who, key)
    body = await svc.volumes.read(record, path)
    return StreamingResponse(body, media_type="application/octet-stream")


@router.put(
    "/{key}/content",
    response_model=VolumeEntry,
    openapi_extra={"requestBody": {"required": True, **BINARY}},
)
async def write_file(
    key: str,
    path: PathQ,
    request: Request,
    svc: DaemonDep,
    who: Auth,
    parents: bool = False,
    mode: Annotated[int | None, Query(ge=0, le=0o7777)] = None,
) -> VolumeEntry:
    """Writes a file whole (the body is its content), within the tenant's quota."""
    record = svc.volumes.record(who, key)
    entry = await svc.volumes.write(record, path, request.stream(), parents, mode)
    return entry_of(entry)


@router.get("/{key}/list", response_model=VolumeEntryList)
async def list_dir(
    key: str,
    path: PathQ,
    svc: DaemonDep,
    who: Auth,
    depth: Annotated[int, Query(ge=1, le=16)] = 1,
) -> VolumeEntryList:
    record = svc.volumes.record(who, key)
    return VolumeEntryList(entries=[entry_of(e) for e in svc.volumes.listing(record, path, depth)])


@router.get("/{key}/stat", response_model=VolumeEntry)
async def stat(key: str, path: PathQ, svc: DaemonDep, who: Auth) -> VolumeEntry:
    return entry_of(svc.volumes.stat(svc.volumes.record(who, key), path))


@router.post("/{key}/mkdir", response_model=VolumeEntry, status_code=201)
async def mkdir(
    key: str, path: PathQ, svc: DaemonDep, who: Auth, parents: bool = False
) -> VolumeEntry:
    return entry_of(svc.volumes.mkdir(svc.volumes.record(who, key), path, parents))


@router.delete("/{key}/content", status_code=204)
async def remove(key: str, path: PathQ, svc: DaemonDep, who: Auth) -> Response:
    """Removes a file, or a directory with what it holds."""
    svc.volumes.remove(svc.volumes.record(who, key), path)
    return Response(status_code=204)
