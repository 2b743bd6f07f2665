"""Snapshots of running sandboxes, and forks from sandboxes or snapshots."""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import FileResponse, StreamingResponse

from cella import errors
from cella.models import (
    ForkRequest,
    Sandbox,
    SandboxList,
    Snapshot,
    SnapshotCreate,
    SnapshotFromImage,
    SnapshotList,
)
from cella.models.fleet import SnapshotExport, SnapshotImport
from cella.server.deps import Auth, DaemonDep, IdempotencyKey
from cella.service.keys import require_admin
from cella.service.shipping import PIECES
from cella.service.transfer import NodeSource

router = APIRouter(tags=["snapshots"])


@router.post("/v1/sandboxes/{sandbox_id}/snapshots", status_code=201, response_model=Snapshot)
async def create_snapshot(
    sandbox_id: str,
    body: SnapshotCreate,
    svc: DaemonDep,
    who: Auth,
    idempotency_key: IdempotencyKey = None,
) -> Snapshot:
    """Saves the sandbox's disk and memory (`memory: false`: its disk alone); it keeps
    running afterwards. With `docker_image`, that image of the sandbox's own Docker becomes
    the snapshot instead. Once per `Idempotency-Key`."""

    async def make() -> list[str]:
        if body.docker_image is not None:
            return [
                svc.images.from_sandbox(
                    who, sandbox_id, body.name, body.docker_image, disk_mib=body.disk_mib
                ).id
            ]
        if body.disk_mib is not None:
            raise errors.InvalidArgument("disk_mib applies to a snapshot of a docker_image")
        return [(await svc.snapshots.snapshot(who, sandbox_id, body.name, memory=body.memory)).id]

    route = f"snapshots.create:{sandbox_id}"
    ids = await svc.idempotency.once(who.tenant, route, idempotency_key, body, make)
    return Snapshot.model_validate(svc.snapshots.resolve(who.tenant, ids[0]))


@router.post("/v1/snapshots", status_code=201, response_model=Snapshot)
async def snapshot_from_image(body: SnapshotFromImage, svc: DaemonDep, who: Auth) -> Snapshot:
    """Builds a snapshot from a registry image, pulled with one of the caller's registries;
    answers `creating` at once (poll it until `ready` or `error`)."""
    row = svc.images.from_image(
        who.tenant,
        body.name,
        body.image,
        tag=body.tag,
        disk_mib=body.disk_mib,
        registry=body.registry,
    )
    return Snapshot.model_validate(row)


@router.post("/v1/sandboxes/{sandbox_id}/fork", status_code=201, response_model=SandboxList)
async def fork_sandbox(
    sandbox_id: str,
    body: ForkRequest,
    svc: DaemonDep,
    who: Auth,
    idempotency_key: IdempotencyKey = None,
) -> SandboxList:
    """`count` isolated copies of a running sandbox, sharing unchanged disk and memory
    (once per `Idempotency-Key`)."""

    async def make() -> list[str]:
        return [r.id for r in await svc.forks.fork(who, sandbox_id, body.count)]

    route = f"sandboxes.fork:{sandbox_id}"
    ids = await svc.idempotency.once(who.tenant, route, idempotency_key, body, make)
    return SandboxList(sandboxes=[Sandbox.model_validate(svc.registry.get(who, i)) for i in ids])


@router.get("/v1/snapshots", response_model=SnapshotList)
async def list_snapshots(svc: DaemonDep, who: Auth, all_tenants: bool = False) -> SnapshotList:
    if all_tenants:
        require_admin(who, "list every tenant's snapshots")
    rows = svc.snapshots.find(None if all_tenants else who.tenant)
    return SnapshotList(snapshots=[Snapshot.model_validate(r) for r in rows])


@router.get("/v1/snapshots/{snapshot_id}", response_model=Snapshot)
async def get_snapshot(snapshot_id: str, svc: DaemonDep, who: Auth) -> Snapshot:
    """A snapshot by id, `name:tag` or bare name (as `snapshot` in a create takes them)."""
    return Snapshot.model_validate(svc.snapshots.resolve(who.tenant, snapshot_id))


@router.post("/v1/snapshots/{snapshot_id}/fork", status_code=201, response_model=SandboxList)
async def fork_snapshot(
    snapshot_id: str,
    body: ForkRequest,
    svc: DaemonDep,
    who: Auth,
    idempotency_key: IdempotencyKey = None,
) -> SandboxList:
    """`count` new sandboxes restored from the snapshot (its checksums are checked first;
    once per `Idempotency-Key`)."""

    async def make() -> list[str]:
        return [r.id for r in await svc.forks.fork_snapshot(who, snapshot_id, body.count)]

    route = f"snapshots.fork:{snapshot_id}"
    ids = await svc.idempotency.once(who.tenant, route, idempotency_key, body, make)
    return SandboxList(sandboxes=[Sandbox.model_validate(svc.registry.get(who, i)) for i in ids])


@router.delete("/v1/snapshots/{snapshot_id}", status_code=204)
async def delete_snapshot(snapshot_id: str, svc: DaemonDep, who: Auth) -> Response:
    """Refused (409 in_use) while a sandbox or another snapshot is built on it."""
    await svc.images.delete(who.tenant, snapshot_id)
    return Response(status_code=204)


# -- between the nodes of a fleet (admin keys: node daemons and their gateway) --------------


class BigChunks(FileResponse):
    chunk_size = 1 << 20  # RAM files are hundreds of MiB: fewer, larger writes


@router.get("/v1/snapshots/{snapshot_id}/export", response_model=SnapshotExport)
async def export_snapshot(
    snapshot_id: str, svc: DaemonDep, who: Auth, layers: bool = False
) -> SnapshotExport:
    """What another node needs to take the snapshot in (any tenant's); a layered one is
    flattened first unless `layers` (then it travels as its layer and the RAM file under
    it)."""
    require_admin(who, "export a snapshot")
    if layers:
        return svc.shipping.describe(snapshot_id)
    return await svc.shipping.export(snapshot_id)


@router.get("/v1/snapshots/{snapshot_id}/files/{name}", response_class=FileResponse)
async def snapshot_file(
    snapshot_id: str, name: str, svc: DaemonDep, who: Auth, extents: bool = False
) -> Response:
    """One of the snapshot's files (`ram`, `state`, `disk.qcow2`); Range requests work.
    `extents`: only its non-zero pieces, with their offsets (`cella.storage.sparse`)."""
    require_admin(who, "read a snapshot's files")
    if extents:
        return StreamingResponse(svc.shipping.pieces(snapshot_id, name), media_type=PIECES)
    return BigChunks(svc.shipping.file(snapshot_id, name))


@router.post("/v1/snapshots/import", status_code=201, response_model=Snapshot)
async def import_snapshot(body: SnapshotImport, svc: DaemonDep, who: Auth) -> Snapshot:
    """Takes in another node's snapshot (and those its disk sits on), checked against its
    manifest; a snapshot already here is returned as it is."""
    require_admin(who, "import a snapshot")
    source = NodeSource(body.source_url, body.source_key, body.source_ca)
    export = await source.export(body.snapshot_id)
    row = await svc.shipping.take_in(export, source.export, source.pull)
    return Snapshot.model_validate(row)
