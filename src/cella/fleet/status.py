"""The fleet as a whole, for its operator: every node's health, capacity, sandboxes, cached
snapshots and templates (`GET /v1/fleet`), with Ray's autoscaler what is asked of it and held,
and the capacity they add up to."""

from __future__ import annotations

import asyncio

from cella import errors
from cella.fleet.cordons import Cordons
from cella.fleet.growth import Growth
from cella.fleet.membership import Membership
from cella.fleet.node_client import GATHER_TIMEOUT, Node
from cella.fleet.placement_table import Placements
from cella.models import Capacity
from cella.models.fleet import FleetNode, FleetStatus


async def fleet_capacity(membership: Membership) -> Capacity:
    answers = await membership.each("GET", "/v1/capacity", None)
    parts = [Capacity.model_validate(a) for _, a in answers]
    return Capacity(
        memory_mib=sum(p.memory_mib for p in parts),
        memory_mib_committed=sum(p.memory_mib_committed for p in parts),
        vcpus=sum(p.vcpus for p in parts),
        vcpus_committed=sum(p.vcpus_committed for p in parts),
        live_sandboxes=sum(p.live_sandboxes for p in parts),
    )


async def fleet_status(
    membership: Membership,
    placements: Placements,
    growth: Growth,
    cordons: Cordons | None = None,
) -> FleetStatus:
    async def one(node: Node) -> FleetNode:
        shown = FleetNode(
            name=node.name,
            cordoned=cordons is not None and node.name in cordons,
            node_id=node.node_id,
            url=node.url,
            healthy=node.healthy,
            reason=node.reason,
            sandboxes=sum(
                1
                for p in placements.on_node(node.name)
                if not p.lost and p.body.get("state") != "deleted"
            ),
        )
        if not node.healthy:
            return shown
        try:
            quick = GATHER_TIMEOUT  # a hung node is shown so, not waited on
            capacity, health, snaps, templates = await asyncio.gather(
                node.json("GET", "/v1/capacity", timeout=quick),
                node.json("GET", "/v1/health", timeout=quick),
                node.json("GET", "/v1/snapshots", params={"all_tenants": "true"}, timeout=quick),
                node.json("GET", "/v1/templates", timeout=quick),
            )
        except errors.CellaError as exc:
            return shown.model_copy(update={"healthy": False, "reason": exc.message})
        return shown.model_copy(
            update={
                "capacity": Capacity.model_validate(capacity),
                "accel": health.get("accel"),
                "pool": health.get("pool") or {},
                "proxy_running": (health.get("proxy") or {}).get("running"),
                "snapshots": [s["id"] for s in snaps["snapshots"] if s["state"] == "ready"],
                "templates": [t["name"] for t in templates["templates"] if t.get("built", True)],
            }
        )

    shown = list(await asyncio.gather(*(one(n) for n in membership.nodes.values())))
    for name, reason in sorted(membership.failures.items()):
        if name not in membership.nodes:
            shown.append(FleetNode(name=name, node_id="", healthy=False, reason=reason))
    return FleetStatus(
        nodes=shown, lost_sandboxes=len(placements.lost()), autoscale=await growth.status()
    )
