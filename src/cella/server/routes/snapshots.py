"""Snapshots of running sandboxes, and forks from sandboxes or snapshots."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response

from cella.models import ForkRequest, Sandbox, SandboxList, Snapshot, SnapshotCreate, SnapshotList
from cella.server.app import Auth
from cella.server.routes._deps import service

router = APIRouter(tags=["snapshots"])


def _snapshot(row: dict[str, Any]) -> Snapshot:
    return Snapshot.model_validate(row)


@router.post("/v1/sandboxes/{sandbox_id}/snapshots", status_code=201, response_model=Snapshot)
async def create_snapshot(
    sandbox_id: str, body: SnapshotCreate, request: Request, who: Auth
) -> Snapshot:
    """Saves the sandbox's disk and memory; it keeps running afterwards."""
    return _snapshot(await service(request).snapshot(who.tenant, sandbox_id, body.name))


@router.post("/v1/sandboxes/{sandbox_id}/fork", status_code=201, response_model=SandboxList)
async def fork_sandbox(
    sandbox_id: str, body: ForkRequest, request: Request, who: Auth
) -> SandboxList:
    """`count` isolated copies of a running sandbox, sharing unchanged disk and memory."""
    rows = await service(request).fork(who.tenant, sandbox_id, body.count)
    return SandboxList(sandboxes=[Sandbox.model_validate(r) for r in rows])


@router.get("/v1/snapshots", response_model=SnapshotList)
async def list_snapshots(request: Request, who: Auth) -> SnapshotList:
    return SnapshotList(
        snapshots=[_snapshot(r) for r in service(request).find_snapshots(who.tenant)]
    )


@router.get("/v1/snapshots/{snapshot_id}", response_model=Snapshot)
async def get_snapshot(snapshot_id: str, request: Request, who: Auth) -> Snapshot:
    return _snapshot(service(request).get_snapshot(who.tenant, snapshot_id))


@router.post("/v1/snapshots/{snapshot_id}/fork", status_code=201, response_model=SandboxList)
async def fork_snapshot(
    snapshot_id: str, body: ForkRequest, request: Request, who: Auth
) -> SandboxList:
    """`count` new sandboxes restored from the snapshot (its checksums are checked first)."""
    rows = await service(request).fork_snapshot(who.tenant, snapshot_id, body.count)
    return SandboxList(sandboxes=[Sandbox.model_validate(r) for r in rows])


@router.delete("/v1/snapshots/{snapshot_id}", status_code=204)
async def delete_snapshot(snapshot_id: str, request: Request, who: Auth) -> Response:
    """Refused (409 in_use) while a sandbox or another snapshot is built on it."""
    await service(request).delete_snapshot(who.tenant, snapshot_id)
    return Response(status_code=204)
