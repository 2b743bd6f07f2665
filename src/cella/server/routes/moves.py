"""Moving a sandbox between the nodes of a fleet, node side (admin keys: the gateway and
node daemons): `export` freezes it here, `import` takes it in on another node under the
same id, then `finish` removes this node's copy, or `abort` lets it run on here. A fleet's
replicas use the same shapes: `replica` copies a sandbox's disk with its row, `recover`
takes it in from a copy held here. See `cella.service.moves` and `cella.service.replicas`."""

from __future__ import annotations

from fastapi import APIRouter, Response

from cella.models import Sandbox
from cella.models.fleet import ReplicaRecover, SandboxExport, SandboxImport, SandboxImported
from cella.server.deps import Auth, DaemonDep
from cella.service.keys import require_admin

router = APIRouter(tags=["fleet"])


@router.post("/v1/sandboxes/import", status_code=201, response_model=SandboxImported)
async def import_sandbox(body: SandboxImport, svc: DaemonDep, who: Auth) -> SandboxImported:
    """Takes in a sandbox another node exported: its snapshot pulled from that node and
    checked, its row written under the same id, its VM restored (running or paused as it
    was; a stopped one's disk laid out)."""
    require_admin(who, "take in a sandbox")
    return await svc.moves.take_in(body)


@router.post("/v1/sandboxes/{sandbox_id}/export", response_model=SandboxExport)
async def export_sandbox(sandbox_id: str, svc: DaemonDep, who: Auth) -> SandboxExport:
    """Freezes the sandbox for a move (any tenant's): snapshotted with its memory and left
    paused, or a stopped one's disk; then `finish` or `abort`."""
    require_admin(who, "move a sandbox")
    return await svc.moves.export(sandbox_id)


@router.post("/v1/sandboxes/{sandbox_id}/export/finish", status_code=204)
async def finish_export(sandbox_id: str, svc: DaemonDep, who: Auth, node: str = "") -> Response:
    """The other node has it: this node's copy goes (`node`: where it went, for its event)."""
    require_admin(who, "move a sandbox")
    await svc.moves.finish(sandbox_id, node)
    return Response(status_code=204)


@router.post("/v1/sandboxes/{sandbox_id}/export/abort", status_code=204)
async def abort_export(sandbox_id: str, svc: DaemonDep, who: Auth, reason: str = "") -> Response:
    """The move failed: the sandbox runs on here as it was."""
    require_admin(who, "move a sandbox")
    await svc.moves.abort(sandbox_id, reason)
    return Response(status_code=204)


@router.post("/v1/sandboxes/recover", status_code=201, response_model=Sandbox)
async def recover_sandbox(body: ReplicaRecover, svc: DaemonDep, who: Auth) -> Sandbox:
    """A fleet's replica held here made its sandbox again (the sandbox's node was lost):
    same id, its files the replica's; paused when the copy has memory, else stopped."""
    require_admin(who, "recover a sandbox from its replica")
    return Sandbox.model_validate(await svc.replicas.recover(body.export, body.event))


@router.post("/v1/sandboxes/{sandbox_id}/replica", response_model=SandboxExport)
async def take_replica(
    sandbox_id: str, svc: DaemonDep, who: Auth, memory: bool = False
) -> SandboxExport:
    """A copy of the sandbox and its row, for a fleet's replica on another node (any
    tenant's): a paused one's disk and memory, a running one's too with `memory` (a live
    snapshot), else its disk alone; it runs on, stays paused or stays stopped."""
    require_admin(who, "copy a sandbox for its replica")
    return await svc.replicas.take(sandbox_id, memory)
