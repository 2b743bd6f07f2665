"""Volumes on a fleet: each lives on one node, its home (its files are that node's), recorded
by the gateway in `homes`; every call on a volume (its content API, cella's and E2B's) goes
there, and lists are merged from every node.

A sandbox mounts a volume through its node's egress proxy and daemon, which serve only
volumes of their own: so a sandbox that mounts volumes is placed on their home (`home_of`
gives the planner that node; volumes of different homes are refused together, by name), as
is a fork of it. A tenant's volume quota holds per node."""

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
        """The node a sandbox mounting `mounts` (a create's `volume_mounts`) must go to;
        None without mounts. Volumes not found are left to the node to refuse."""
        if not isinstance(mounts, list) or not mounts:
            return None
        homes: dict[str, list[str]] = {}
        for mount in mounts:
            key = mount.get("volume") if isinstance(mount, dict) else None
            if not isinstance(key, str):
                continue
            found = await self.find(who, key)
            if found is None:
                raise errors.InvalidArgument(f"volume_mounts: no volume {key!r}")
            homes.setdefault(found.node, []).append(found.name)
        if len(homes) > 1:
            shown = "; ".join(f"{', '.join(v)} on {k}" for k, v in sorted(homes.items()))
            raise errors.InvalidArgument(
                f"volume_mounts: the volumes live on different nodes ({shown}); a sandbox "
                "mounts volumes of one node only"
            )
        return next(iter(homes), None)
