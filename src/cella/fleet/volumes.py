"""Volumes on a fleet: each lives on one node, its home (its files are that node's), recorded
by the gateway in `homes`; every call on a volume (its content API, cella's and E2B's) goes
there, and lists are merged from every node.

A sandbox may mount a volume on any node: before the create, the gateway lends the
sandbox's node each mounted volume that lives elsewhere (`lend`: the home's URL and
certificate and the volume's token there, `PUT /v1/volumes/{id}/remote`, with the node's
admin key), and that node sends its sandboxes' WebDAV requests for it on to the home
(`service/remote_volumes.py`). Such a sandbox is placed on its first volume's home when it
has room and no other node was asked for (no network hop); a fork of it stays on its node.
A tenant's volume quota holds per node."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import httpx2

from cella import errors
from cella.fleet.homes import Home, Homes
from cella.fleet.membership import Membership
from cella.fleet.node_client import Node
from cella.service.keys import Principal

KIND = "volume"
# how a node is asked to make a volume (cella's API or E2B's), and the id and name it made
Make = Callable[[Node], Awaitable[httpx2.Response]]


class FleetVolumes:
    def __init__(self, membership: Membership, homes: Homes) -> None:
        self.membership = membership
        self.homes = homes

    def pick(self) -> Node:
        """The node a new volume goes to: the healthy one that is home to the fewest."""
        nodes = self.membership.healthy()
        if not nodes:
            raise errors.NodeUnavailable("no node of the fleet is up")
        return min(nodes, key=lambda n: (self.homes.count_on(KIND, n.name), n.name))

    async def create(self, who: Principal, name: str, make: Make) -> httpx2.Response:
        """A volume made on the node `pick` chooses, by `make`; refused if the tenant has one
        of that name on any node."""
        if await self.find(who, name) is not None:
            raise errors.AlreadyExists(f"volume {name!r} already exists")
        node = self.pick()
        answer = await make(node)
        if answer.is_success:
            made = answer.json()
            volume_id = str(made.get("id") or made.get("volumeID"))
            self.homes.put(Home(KIND, who.tenant, volume_id, name, node.name))
        return answer

    async def find(self, who: Principal, key: str) -> Home | None:
        """The tenant's volume `key` (id or name), wherever it is (the nodes asked when
        the gateway has no record of it)."""
        found = self.homes.find(KIND, who.tenant, key)
        if found is not None:
            return found
        for node in self.membership.healthy():
            answer = await node.call("GET", f"/v1/volumes/{key}", who)
            if answer.status_code == 200:
                got = answer.json()
                home = Home(KIND, who.tenant, str(got["id"]), str(got["name"]), node.name)
                self.homes.put(home)
                return home
        return None

    async def home(self, who: Principal, key: str) -> tuple[Home, Node]:
        """The tenant's volume `key` and its node (which must be up)."""
        found = await self.find(who, key)
        if found is None:
            raise errors.NotFound(f"volume {key} not found")
        return found, self.up(found)

    def home_by_id(self, volume_id: str) -> Node:
        """The node of a volume by its id alone (its content API: the volume's own token
        is checked there)."""
        found = self.homes.by_id(KIND, volume_id)
        if found is None:
            raise errors.NotFound(f"volume {volume_id} not found")
        return self.up(found)

    def up(self, home: Home) -> Node:
        node = self.membership.up(home.node)
        if node is None:
            raise errors.NodeUnavailable(f"node {home.node}, home of volume {home.name}, is down")
        return node

    def forget(self, home: Home) -> None:
        self.homes.forget(KIND, home.id)

    async def listed(self, who: Principal) -> dict[str, Any]:
        """cella's list: every node's volumes of the tenant, their bytes summed."""
        volumes: list[Any] = []
        used, quota = 0, None
        for node, answer in await self.membership.each("GET", "/v1/volumes", who):
            for body in answer["volumes"]:
                self.homes.put(Home(KIND, who.tenant, body["id"], body["name"], node.name))
                volumes.append(body)
            used += int(answer.get("used_bytes") or 0)
            quota = answer.get("quota_bytes")
        volumes.sort(key=lambda v: str(v.get("created_at")))
        return {"volumes": volumes, "quota_bytes": quota, "used_bytes": used}

    async def home_of(self, who: Principal, mounts: Any) -> str | None:
        """The node a sandbox mounting `mounts` (a create's `volume_mounts`) is best placed
        on: its first volume's home (None without mounts); `InvalidArgument` naming a
        volume the tenant has on no node."""
        homes = [await self._mounted(who, key) for key in _keys(mounts)]
        return homes[0].node if homes else None

    async def lend(self, who: Principal, node: Node, mounts: Any) -> None:
        """`node` told of each volume in `mounts` that lives on another node, so that its
        sandbox mounts it there."""
        for key in _keys(mounts):
            found = await self._mounted(who, key)
            if found.node == node.name:
                continue
            home = self.up(found)
            shown = await home.json("GET", f"/volumes/{found.id}", who, langsmith=True)
            lent = {"tenant": who.tenant, "name": found.name, "url": home.url,
                    "token": shown["token"], "ca_pem": home.ca_pem}  # fmt: skip
            await node.json("PUT", f"/v1/volumes/{found.id}/remote", json=lent)

    async def _mounted(self, who: Principal, key: str) -> Home:
        found = await self.find(who, key)
        if found is None:
            raise errors.InvalidArgument(f"volume_mounts: no volume {key!r}")
        return found


def _keys(mounts: Any) -> list[str]:
    """The volumes (ids or names) a create's `volume_mounts` names."""
    if not isinstance(mounts, list):
        return []
    return [str(m["volume"]) for m in mounts if isinstance(m, dict) and "volume" in m]
