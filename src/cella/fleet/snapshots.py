"""Snapshots across the fleet: each is kept by the node it was taken on and by every node
it was shipped to (pulled from a holder over HTTP, verified against its manifest, then
cached); found by asking the nodes, removed from all of them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cella import errors
from cella.fleet.membership import Membership
from cella.fleet.node_client import Node
from cella.service.keys import Principal


class FleetSnapshots:
    def __init__(self, membership: Membership) -> None:
        self.membership = membership
        # the gateway's own snapshots, never listed (replicas)
        self.hidden: Callable[[dict[str, Any]], bool] = lambda _: False

    async def resolve(self, who: Principal, ref: str) -> tuple[dict[str, Any], set[str]]:
        """The snapshot `ref` names (the newest answer if nodes differ), and the nodes
        holding it."""
        answers = []
        for node in self.membership.healthy():
            response = await node.call("GET", f"/v1/snapshots/{ref}", who)
            if response.status_code == 200:
                answers.append((node.name, response.json()))
        if not answers:
            raise errors.NotFound(f"no snapshot {ref!r}")
        chosen = max((a for _, a in answers), key=lambda a: str(a["created_at"]))
        if chosen["state"] != "ready":
            raise errors.InvalidState(f"snapshot {chosen['id']} is {chosen['state']}")
        return chosen, {name for name, a in answers if a["id"] == chosen["id"]}

    async def holder(self, who: Principal, ref: str) -> Node:
        """A node that holds the caller's snapshot `ref` (the first by name)."""
        _, holders = await self.resolve(who, ref)
        return self.membership.nodes[sorted(holders)[0]]

    async def ship(self, snapshot_id: str, holders: set[str], dest: Node) -> None:
        """Has `dest` pull the snapshot from a node that holds it (once: then it is cached)."""
        nodes = self.membership.nodes
        sources = [nodes[h] for h in sorted(holders) if nodes[h].healthy]
        if not sources:
            raise errors.NodeUnavailable(f"no node holding snapshot {snapshot_id} is up")
        source = sources[0]
        await dest.json(
            "POST",
            "/v1/snapshots/import",
            json={
                **source.as_source(),
                "snapshot_id": snapshot_id,
            },
        )

    async def list(self, who: Principal, all_tenants: bool = False) -> list[Any]:
        seen: dict[str, dict[str, Any]] = {}
        params = {"all_tenants": "true"} if all_tenants else {}
        for _, answer in await self.membership.each("GET", "/v1/snapshots", who, params=params):
            for body in answer["snapshots"]:
                if not self.hidden(body):
                    seen.setdefault(body["id"], body)
        return sorted(seen.values(), key=lambda b: str(b["created_at"]))

    async def delete(self, who: Principal, snapshot_id: str) -> None:
        """Removed from every node holding it (refused while one of them uses it)."""
        holders = [
            n
            for n in self.membership.healthy()
            if (await n.call("GET", f"/v1/snapshots/{snapshot_id}", who)).status_code == 200
        ]
        if not holders:
            raise errors.NotFound(f"no snapshot {snapshot_id!r}")
        for node in holders:
            await node.json("DELETE", f"/v1/snapshots/{snapshot_id}", who)
