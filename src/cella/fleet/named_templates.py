"""A tenant's named templates on a fleet (E2B's build API: `Template` built from steps): each
is built and kept on one node, its home, recorded in `homes`; every call on it (build
requests, file uploads, status, logs, tags) goes there, and its sandboxes are placed there
(the planner places a template's sandboxes where it is built)."""

from __future__ import annotations

from cella import errors
from cella.fleet.homes import Home, Homes
from cella.fleet.membership import Membership
from cella.fleet.node_client import Node
from cella.service.keys import Principal

KIND = "template"


class NamedTemplates:
    def __init__(self, membership: Membership, homes: Homes) -> None:
        self.membership = membership
        self.homes = homes

    def where_new(self, who: Principal, name: str) -> Node:
        """The node a build of `name` goes to: its home if it has one, else the healthy
        node home to the fewest."""
        found = self.homes.find(KIND, who.tenant, name)
        if found is not None:
            return self.up(found)
        nodes = self.membership.healthy()
        if not nodes:
            raise errors.NodeUnavailable("no node of the fleet is up")
        return min(nodes, key=lambda n: (self.homes.count_on(KIND, n.name), n.name))

    def record(self, who: Principal, template_id: str, name: str, node: Node) -> None:
        self.homes.put(Home(KIND, who.tenant, template_id, name, node.name))

    async def node_of(self, who: Principal, key: str) -> Node:
        """The home of the tenant's named template `key` (id or name; the nodes asked when
        the gateway has no record of it)."""
        found = self.homes.find(KIND, who.tenant, key)
        if found is None:
            for node in self.membership.healthy():
                answer = await node.call("GET", f"/templates/{key}", who, langsmith=True)
                if answer.status_code == 200:
                    got = answer.json()
                    names = got.get("names") or got.get("aliases") or [key]
                    self.record(who, str(got["templateID"]), str(names[0]), node)
                    return node
            raise errors.NotFound(f"template '{key}' not found")
        return self.up(found)

    def known(self, who: Principal, key: str) -> bool:
        return self.homes.find(KIND, who.tenant, key) is not None

    def node_by_id(self, template_id: str) -> Node:
        """The home of a named template by its id alone (an upload link's own token is
        checked there)."""
        found = self.homes.by_id(KIND, template_id)
        if found is None:
            raise errors.NotFound(f"template {template_id} not found")
        return self.up(found)

    def forget(self, who: Principal, key: str) -> None:
        found = self.homes.find(KIND, who.tenant, key)
        if found is not None:
            self.homes.forget(KIND, found.id)

    def up(self, home: Home) -> Node:
        node = self.membership.up(home.node)
        if node is None:
            raise errors.NodeUnavailable(f"node {home.node}, home of template {home.name}, is down")
        return node
