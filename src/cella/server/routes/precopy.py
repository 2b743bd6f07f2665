"""A move's pre-copy, node side (admin keys: the gateway and node daemons): the source
splits a running sandbox's disk and offers what it wrote so far and the RAM file under its
memory; the destination pulls them while the guest runs, so the move's freeze ships only
what changed since. See `cella.service.precopy`."""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import StreamingResponse

from cella.models.fleet import PrecopyOffer, PrecopyTake, PrecopyTaken
from cella.server.deps import Auth, DaemonDep
from cella.service.keys import require_admin
from cella.service.shipping import PIECES

router = APIRouter(tags=["fleet"])


@router.post("/v1/sandboxes/precopy", status_code=201, response_model=PrecopyTaken)
async def take_precopy(body: PrecopyTake, svc: DaemonDep, who: Auth) -> PrecopyTaken:
    """Pulls what another node offers ahead of a sandbox's move here (its disk so far, the
    RAM file under its memory), each checked; the move's import then uses them."""
    require_admin(who, "take in a sandbox")
    return await svc.moves.precopy.take(body)


@router.post("/v1/sandboxes/{sandbox_id}/precopy", response_model=PrecopyOffer)
async def start_precopy(sandbox_id: str, svc: DaemonDep, who: Auth) -> PrecopyOffer:
    """Splits a running sandbox's disk (it runs on) and offers what it wrote so far and
    the RAM file under its memory to the node it moves to; then its `export`, or `abort`
    (the disk merged back). A sandbox that is not running gets an empty offer."""
    require_admin(who, "move a sandbox")
    return await svc.moves.precopy.start(sandbox_id)


@router.get("/v1/sandboxes/{sandbox_id}/precopy/ram")
async def precopy_ram(sandbox_id: str, svc: DaemonDep, who: Auth) -> Response:
    """The RAM file a pre-copy offered, as its non-zero pieces (`cella.storage.sparse`)."""
    require_admin(who, "move a sandbox")
    return StreamingResponse(svc.moves.precopy.ram_pieces(sandbox_id), media_type=PIECES)


@router.delete("/v1/sandboxes/{sandbox_id}/precopy/staged", status_code=204)
async def drop_precopy(sandbox_id: str, svc: DaemonDep, who: Auth) -> Response:
    """What this node took in ahead of a move of the sandbox that did not happen goes."""
    require_admin(who, "take in a sandbox")
    await svc.moves.precopy.drop(sandbox_id)
    return Response(status_code=204)
