"""Moving sandboxes between the fleet's nodes, and draining a node (cordon, then move
everything off it).

A move drives the nodes' primitive (`cella.service.moves`): the source freezes the sandbox
and snapshots it (`export`), the destination pulls that snapshot and restores it under the
same id (`import`), and only once the destination answers for it does the placement table
point there and the source drop its copy (`finish`). Any failure before that has the
source let it run on as it was (`abort`), and the move says why.

A running sandbox's move starts with a pre-copy (`precopy.py`): its disk so far and the RAM
file under its memory go to the destination while the guest runs, so the freeze ships
only what changed since. The guest's pause is measured from its freeze on the source (the
source's own count of how long it has held it) plus the gateway's wait for the
destination's restore: an upper bound that includes the calls' round trips.

A sandbox that mounts volumes moves when each volume stays reachable from the destination:
a volume lives on its home node (`FleetVolumes`), which the destination is, or which lends
it the volume (as at a create) before the move, so that the guest's mount (rclone, still
running in its memory) goes on through the destination to the home. A volume whose home is
down, or is the node being drained (volumes do not move: the node will go), keeps the
sandbox where it is, and the move's report says so; the rest of a drain goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from cella import errors
from cella.fleet import precopy
from cella.fleet.cordons import Cordons
from cella.fleet.growth import Growth
from cella.fleet.locator import Locator
from cella.fleet.membership import Membership
from cella.fleet.node_client import Node
from cella.fleet.planner import Planner, Shape
from cella.fleet.volumes import FleetVolumes
from cella.models.fleet import DrainReport, MoveReport
from cella.service.keys import Principal

log = logging.getLogger("cella.gateway.moves")
MOVABLE = ("running", "paused", "stopped")


class FleetMoves:
    def __init__(
        self,
        membership: Membership,
        locator: Locator,
        planner: Planner,
        cordons: Cordons,
        growth: Growth | None = None,
        volumes: FleetVolumes | None = None,
    ) -> None:
        self.membership = membership
        self.locator = locator
        self.planner = planner
        self.cordons = cordons
        self.growth = growth  # a node a sandbox moves to is held against the autoscaler
        self.volumes = volumes  # the homes of the volumes a moving sandbox mounts
        self._moving: set[str] = set()

    async def move(self, who: Principal, sandbox_id: str, to: str | None = None) -> MoveReport:
        """Moves the caller's sandbox to node `to` (else one the planner picks, never its
        own); raises, the sandbox untouched, if no node can take it."""
        where = await self.locator.placement(who, sandbox_id)
        source = self.locator.usable(where)
        body: dict[str, Any] = await source.json("GET", f"/v1/sandboxes/{sandbox_id}", who)
        dest = await self._destination(body, source.name, to)
        await self._volumes_reach(body, dest)
        return await self._move(sandbox_id, body, source, dest)

    async def drain(self, node_name: str) -> DrainReport:
        """Cordons the node, then moves each of its sandboxes to another node, one by one
        (a failed one stays, and its report says why)."""
        node = self.membership.nodes.get(node_name)
        if node is None:
            raise errors.NotFound(f"no node {node_name!r} in the fleet")
        self.cordons.cordon(node_name)
        node = self.membership.up(node_name)
        if node is None:
            raise errors.NodeUnavailable(f"node {node_name} is down: nothing can leave it")
        listed = await node.json("GET", "/v1/sandboxes", params={"all_tenants": "true"})
        reports = []
        for body in sorted(listed["sandboxes"], key=lambda b: str(b.get("created_at"))):
            if body.get("state") in ("deleted", "deleting"):
                continue
            try:
                dest = await self._destination(body, node_name, None)
                await self._volumes_reach(body, dest, draining=node_name)
                reports.append(await self._move(body["id"], body, node, dest))
            except errors.CellaError as exc:
                reports.append(
                    MoveReport(
                        id=body["id"],
                        source=node_name,
                        state=str(body.get("state")),
                        ok=False,
                        error=exc.message,
                    )
                )
        return DrainReport(node=node_name, cordoned=True, moves=reports)

    async def _destination(self, body: dict[str, Any], source: str, to: str | None) -> Node:
        """The node a sandbox goes to: `to` if it is up, open and not its own; else the
        planner's choice among the others."""
        if body.get("state") not in MOVABLE:
            raise errors.InvalidState(f"cannot move a sandbox that is {body.get('state')}")
        if to is not None:
            if to not in self.membership.nodes:
                raise errors.InvalidArgument(f"no node {to!r} in the fleet")
            if to == source:
                raise errors.InvalidArgument(f"sandbox {body['id']} is on node {to} already")
            if to in self.cordons:
                raise errors.InvalidState(f"node {to} is cordoned: nothing new is placed there")
            node = self.membership.up(to)
            if node is None:
                raise errors.NodeUnavailable(f"node {to} is down")
            return node
        shape = Shape(int(body["vcpus"]), int(body["memory_mib"]), str(body["template"]))
        plan = await self.planner.plan(shape, 1, set(), exclude=frozenset({source}))
        return self.membership.nodes[next(iter(plan))]

    async def _volumes_reach(
        self, body: dict[str, Any], dest: Node, draining: str | None = None
    ) -> None:
        """Each volume the sandbox mounts reachable from `dest` (its home, up, lends it
        there); `draining`: refused if one lives on that node. Raises naming the volume."""
        mounts = body.get("volume_mounts") or []
        if not mounts:
            return
        if self.volumes is None:
            raise errors.InvalidState(f"sandbox {body['id']} mounts volumes: it stays")
        owner = Principal.service(str(body.get("tenant") or ""))
        for mount in mounts:
            home = await self.volumes.find(owner, str(mount["volume"]))
            if home is None:
                raise errors.InvalidState(
                    f"sandbox {body['id']} mounts volume {mount['volume']}, which no node "
                    "holds: it stays"
                )
            if home.node == draining:
                raise errors.InvalidState(
                    f"sandbox {body['id']} mounts volume {home.name}, which lives on node "
                    f"{draining} (volumes do not move): it stays there with it"
                )
            if self.membership.up(home.node) is None:
                raise errors.InvalidState(
                    f"sandbox {body['id']} mounts volume {home.name}, whose node {home.node} "
                    "is down: it stays"
                )
        await self.volumes.lend(owner, dest, mounts)  # dest sends their requests home

    async def _move(
        self, sandbox_id: str, body: dict[str, Any], source: Node, dest: Node
    ) -> MoveReport:
        if sandbox_id in self._moving:
            raise errors.InvalidState(f"sandbox {sandbox_id} is being moved already")
        self._moving.add(sandbox_id)
        try:
            return await self._ship(sandbox_id, body, source, dest)
        finally:
            self._moving.discard(sandbox_id)

    async def _ship(
        self, sandbox_id: str, body: dict[str, Any], source: Node, dest: Node
    ) -> MoveReport:
        shape = Shape(int(body["vcpus"]), int(body["memory_mib"]), str(body["template"]))
        if self.growth is not None:
            await self.growth.hold([dest.name])
        ahead = await precopy.ahead(sandbox_id, source, dest)
        try:
            export = await source.json("POST", f"/v1/sandboxes/{sandbox_id}/export")
        except BaseException:
            if ahead is not None:  # the source merges its disk back; the destination drops
                with contextlib.suppress(errors.CellaError):
                    await source.json("POST", f"/v1/sandboxes/{sandbox_id}/export/abort")
                await precopy.undo(sandbox_id, dest)
            raise
        loop = asyncio.get_running_loop()
        frozen = loop.time()
        state = str(export["state"])
        try:
            with self.planner.reserve({dest.name: 1}, shape):
                taken = await dest.json(
                    "POST",
                    "/v1/sandboxes/import",
                    json={
                        **source.as_source(),
                        "export": export,
                    },
                )
            owner = Principal.service(str(body.get("tenant") or ""))
            # it answers there, as its tenant's
            shown = await dest.json("GET", f"/v1/sandboxes/{sandbox_id}", owner)
            if shown.get("state") != state:
                raise errors.CellaError(f"it came up {shown.get('state')} there, not {state}")
        except BaseException as exc:
            reason = exc.message if isinstance(exc, errors.CellaError) else repr(exc)
            try:
                await source.json(
                    "POST", f"/v1/sandboxes/{sandbox_id}/export/abort", params={"reason": reason}
                )
            except errors.CellaError as undo:  # the source itself is gone: nothing to resume
                log.error("sandbox %s: the move's undo failed: %s", sandbox_id, undo.message)
            if ahead is not None:
                await precopy.undo(sandbox_id, dest)
            if isinstance(exc, errors.CellaError):
                raise type(exc)(f"moving {sandbox_id} to {dest.name} failed: {reason}") from None
            raise
        paused_ms = None
        if state != "stopped":
            paused_ms = round(float(export["held_ms"]) + (loop.time() - frozen) * 1000, 1)
        try:
            await source.json(
                "POST", f"/v1/sandboxes/{sandbox_id}/export/finish", params={"node": dest.name}
            )
        except errors.CellaError as exc:  # moved: the source's copy is left to remove later
            log.error("sandbox %s moved, but node %s kept its copy: %s", sandbox_id,
                      source.name, exc.message)  # fmt: skip
        # after the source let go: a list of the nodes meanwhile may have seen it there
        self.locator.placements.put(dest.name, shown)
        return MoveReport(
            id=sandbox_id,
            source=source.name,
            to=dest.name,
            state=state,
            ok=True,
            paused_ms=paused_ms,
            bytes=int(taken.get("bytes") if taken.get("bytes") is not None else export["bytes"]),
            transfer_ms=float(taken["transfer_ms"]),
            precopy_ms=ahead.ms if ahead is not None else None,
            precopy_bytes=ahead.bytes if ahead is not None else None,
        )
