"""The gateway's routes for moving sandboxes: one (`POST /v1/sandboxes/{id}/move`, by a
caller who may manage it), or every one of a node (`drain`, admin), and the node's cordon."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from cella import errors
from cella.fleet.gateway import Gateway
from cella.fleet.locator import access_shown
from cella.models.fleet import DrainReport, MoveReport, MoveRequest
from cella.policy import access
from cella.server.deps import Auth
from cella.service.keys import require_admin


def router(gateway: Gateway) -> APIRouter:
    api = APIRouter(tags=["fleet"])

    @api.post("/v1/sandboxes/{sandbox_id}/move", response_model=MoveReport,
              response_model_by_alias=True)  # fmt: skip
    async def move(sandbox_id: str, who: Auth, body: MoveRequest | None = None) -> Any:
        """Moves the sandbox to another node (`node`, else one the planner picks), same id,
        its state kept (a running one's processes go on); a failed move leaves it where it
        was, as it was, and says why."""
        where = await gateway.locator.placement(who, sandbox_id)
        granted = access.permission(who, access_shown(who.tenant, where.body))
        if not who.admin and granted != access.Permission.manage:
            raise errors.PermissionDenied(f"this key may not move sandbox {sandbox_id}")
        return await gateway.moves.move(who, sandbox_id, body.node if body else None)

    @api.post("/v1/fleet/nodes/{node}/drain", response_model=DrainReport,
              response_model_by_alias=True)  # fmt: skip
    async def drain(node: str, who: Auth) -> Any:
        """Cordons the node, then moves every sandbox on it to other nodes; a report of each
        move (id, from, to, the guest's pause, bytes shipped, transfer time) (admin)."""
        require_admin(who, "drain a node")
        return await gateway.moves.drain(node)

    @api.post("/v1/fleet/nodes/{node}/cordon", tags=["fleet"])
    async def cordon(node: str, who: Auth) -> dict[str, Any]:
        """Nothing new is placed on the node; what runs there stays (admin)."""
        require_admin(who, "cordon a node")
        if node not in gateway.membership.nodes:
            raise errors.NotFound(f"no node {node!r} in the fleet")
        gateway.cordons.cordon(node)
        return {"node": node, "cordoned": True}

    @api.post("/v1/fleet/nodes/{node}/uncordon", tags=["fleet"])
    async def uncordon(node: str, who: Auth) -> dict[str, Any]:
        """New sandboxes may be placed on the node again (admin)."""
        require_admin(who, "uncordon a node")
        if node not in gateway.membership.nodes and node not in gateway.cordons:
            raise errors.NotFound(f"no node {node!r} in the fleet")
        gateway.cordons.uncordon(node)
        return {"node": node, "cordoned": False}

    return api
