"""Snapshots of running sandboxes, and forks from sandboxes or snapshots."""

from __future__ import annotations

from fastapi import APIRouter, Response

from cella.models import ForkRequest, Sandbox, SandboxList, Snapshot, SnapshotCreate, SnapshotList
from cella.server.deps import Auth, Service

router = APIRouter(tags=["snapshots"])


@router.post("/v1/sandboxes/{sandbox_id}/snapshots", status_code=201, response_model=Snapshot)
async def create_snapshot(
    sandbox_id: str, body: SnapshotCreate, svc: Service, who: Auth
) -> Snapshot:
    """Saves the sandbox's disk and memory; it keeps running afterwards."""
    return Snapshot.model_validate(await svc.snapshots.snapshot(who.tenant, sandbox_id, body.name))


@router.post("/v1/sandboxes/{sandbox_id}/fork", status_code=201, response_model=SandboxList)
async def fork_sandbox(sandbox_id: str, body: ForkRequest, svc: Service, who: Auth) -> SandboxList:
    """`count` isolated copies of a running sandbox, sharing unchanged disk and memory."""
    rows = await svc.snapshots.fork(who.tenant, sandbox_id, body.count)
    return SandboxList(sandboxes=[Sandbox.model_validate(r) for r in rows])


@router.get("/v1/snapshots", response_model=SnapshotList)
async def list_snapshots(svc: Service, who: Auth) -> SnapshotList:
    rows = svc.snapshots.find(who.tenant)
    return SnapshotList(snapshots=[Snapshot.model_validate(r) for r in rows])


@router.get("/v1/snapshots/{snapshot_id}", response_model=Snapshot)
async def get_snapshot(snapshot_id: str, svc: Service, who: Auth) -> Snapshot:
    return Snapshot.model_validate(svc.snapshots.get(who.tenant, snapshot_id))


@router.post("/v1/snapshots/{snapshot_id}/fork", status_code=201, response_model=SandboxList)
async def fork_snapshot(
    snapshot_id: str, body: ForkRequest, svc: Service, who: Auth
) -> SandboxList:
    """`count` new sandboxes restored from the snapshot (its checksums are checked first)."""
    rows = await svc.snapshots.fork_snapshot(who.tenant, snapshot_id, body.count)
    return SandboxList(sandboxes=[Sandbox.model_validate(r) for r in rows])


@router.delete("/v1/snapshots/{snapshot_id}", status_code=204)
async def delete_snapshot(snapshot_id: str, svc: Service, who: Auth) -> Response:
    """Refused (409 in_use) while a sandbox or another snapshot is built on it."""
    await svc.snapshots.delete(who.tenant, snapshot_id)
    return Response(status_code=204)
