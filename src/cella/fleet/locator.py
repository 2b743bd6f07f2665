"""Where the fleet's sandboxes are: the placement table, filled in from the nodes' own
answers whenever the gateway has not seen a sandbox yet, and lists merged from every node
(with the sandboxes of nodes that are gone, as `lost`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cella import errors
from cella.fleet.membership import Membership
from cella.fleet.node_client import Node
from cella.fleet.placement_table import Placement, Placements
from cella.policy import access
from cella.service.keys import Principal


class Locator:
    def __init__(self, membership: Membership, placements: Placements) -> None:
        self.membership = membership
        self.placements = placements
        # a node's answer as the gateway shows it (what replicas add)
        self.shown: Callable[[dict[str, Any]], dict[str, Any]] = lambda body: body

    async def placement(self, who: Principal, sandbox_id: str) -> Placement:
        """The tenant's sandbox, wherever it is (nodes asked if the gateway has not seen it)."""
        found = self.placements.get(sandbox_id)
        if found is None:
            for node in self.membership.healthy():
                response = await node.call("GET", f"/v1/sandboxes/{sandbox_id}", who)
                if response.status_code == 200:
                    self.placements.put(node.name, response.json())
                    found = self.placements.get(sandbox_id)
                    break
        if found is None or found.tenant != who.tenant:
            raise errors.NotFound(f"no sandbox {sandbox_id!r}")
        return found

    async def placement_named(self, who: Principal, name: str) -> Placement:
        """The sandbox `who` means by `name` (the LangSmith API addresses boxes by name),
        as a node would pick it (`access.meant`)."""
        for attempt in range(2):
            named = [
                found
                for found in self.placements.of_tenant(who.tenant)
                if found.body.get("name") == name and found.body.get("state") != "deleted"
            ]
            picked = access.meant(who, [access_shown(who.tenant, f.body) for f in named])
            if len(picked) > 1:
                ids = ", ".join(named[i].sandbox_id for i in picked)
                raise errors.Conflict(
                    f"this key may see {len(picked)} sandboxes named {name!r} ({ids}): "
                    "address one by its id"
                )
            if picked:
                return named[picked[0]]
            if attempt == 0:  # not seen yet: ask the nodes
                await self.list_sandboxes(who, [])
        raise errors.NotFound(f"no sandbox named {name!r}")

    def usable(self, where: Placement) -> Node:
        if where.lost:
            raise errors.SandboxLost(f"sandbox {where.sandbox_id} is lost: {where.lost}")
        node = self.membership.up(where.node)
        if node is None:
            raise errors.NodeUnavailable(f"node {where.node} of {where.sandbox_id} is down")
        return node

    async def node_of(self, who: Principal, sandbox_id: str) -> Node:
        return self.usable(await self.placement(who, sandbox_id))

    def serving(self, sandbox_id: str) -> Node | None:
        """The node of a sandbox's forwarded ports, if it is up (no caller to check: a
        service URL's own token is checked on the node)."""
        where = self.placements.get(sandbox_id)
        return self.membership.up(where.node) if where and not where.lost else None

    async def list_sandboxes(self, who: Principal, params: list[tuple[str, str]]) -> list[Any]:
        found: list[dict[str, Any]] = []
        for node, answer in await self.membership.each("GET", "/v1/sandboxes", who, params=params):
            if answer["sandboxes"]:  # one transaction per node's list
                self.placements.put_many(node.name, answer["sandboxes"])
                found.extend(map(self.shown, answer["sandboxes"]))
        state = dict(params).get("state")
        if state in (None, "lost"):
            labels = [v for k, v in params if k == "label"]
            for lost in self.placements.lost(who.tenant):
                shown = self.shown(lost.shown())
                if not visible(who, shown):  # as its node would have listed it
                    continue
                have = shown.get("labels") or {}
                if all(have.get(k) == v for k, _, v in (p.partition("=") for p in labels)):
                    found.append(shown)
        if state is not None:
            found = [b for b in found if b.get("state") == state]
        return sorted(found, key=lambda b: str(b.get("created_at")))

    def woken(self, sandbox_id: str) -> None:
        """Resumed through a call the gateway relayed: live again, as its quota counts it
        (until the node's own answer to a list says more)."""
        self.placements.set_state(sandbox_id, "starting")

    def deleted(self, sandbox_id: str) -> None:
        """Deleted on its node: still routed there (its trace), never listed."""
        self.placements.deleted(sandbox_id)

    def forget(self, sandbox_id: str) -> None:
        """A lost sandbox deleted: nothing is left of it to route to."""
        self.placements.forget(sandbox_id)


def visible(who: Principal, shown: dict[str, Any]) -> bool:
    """Whether `who` may see a sandbox as a node showed it (`cella.policy.access`)."""
    return access.permission(who, access_shown(who.tenant, shown)) is not None


def access_shown(tenant: str, shown: dict[str, Any]) -> access.Access:
    """A sandbox of `tenant` as a node showed it, as the access rule sees it."""
    levels = access.Permission.__members__
    shares = {p: levels[v] for p, v in (shown.get("shares") or {}).items() if v in levels}
    private = shown.get("visibility") == "private"
    return access.Access(tenant, shown.get("creator"), "private" if private else "tenant", shares)
