"""The fleet grows and shrinks with Ray's autoscaler (the `fleet_autoscale` setting).

Grows: a create that no node has room for asks the autoscaler for one more `cella_node` node
than the fleet has and waits (up to `fleet_scale_up_wait_s`) while nodes join, trying again
as each one does. Shrinks: every node with sandboxes (in any state: a stopped one's disk is
there too) is held (`autoscaler.hold`) and so never idle in Ray's eyes; a node whose last
sandbox has been gone for `fleet_scale_down_grace_s` is released: it leaves the fleet, its
daemon and the daemon's actor end (a node with a live actor is busy to Ray) and its hold
goes, and the autoscaler removes it after its own idle timeout. Demand that comes before it
has gone brings it back. Off, a create with no room is refused at once, as it always was.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable

from cella import errors
from cella.fleet import autoscaler, cluster
from cella.fleet.membership import Membership
from cella.fleet.planner import Planner
from cella.models.fleet import FleetGrowth
from cella.service.periodic import Periodic

log = logging.getLogger("cella.fleet")
PASS_SECONDS = 2.0  # how often the floor asked for and the holds are brought up to date
RETRY_SECONDS = 1.0  # how often a waiting create tries again (nodes join about as often)
NO_ROOM = (errors.CapacityExceeded, errors.NodeUnavailable)


class Growth:
    def __init__(
        self,
        membership: Membership,
        planner: Planner,
        enabled: bool,
        wait_s: float,
        grace_s: float,
    ) -> None:
        self.membership = membership
        self.planner = planner  # nodes being placed on are busy before they list anything
        self.enabled = enabled
        self.wait_s = wait_s
        self.grace_s = grace_s
        self.waiting = 0  # creates waiting for a node
        self._asked = 0  # the floor of sandbox nodes asked for (0: none)
        self._idle_since: dict[str, float] = {}  # node name -> when it was last seen empty
        self._pass = Periodic("fleet growth", self.tend, lambda: PASS_SECONDS, log)

    async def start(self) -> None:
        if self.enabled:
            await asyncio.to_thread(autoscaler.ask, 0)  # a floor a previous gateway left
            self._pass.start()

    async def shutdown(self) -> None:
        await self._pass.close()

    async def plan(
        self, attempt: Callable[[], Awaitable[dict[str, int]]], only: str | None
    ) -> dict[str, int]:
        """`attempt`'s plan; when the fleet has no room, asks for a node and tries again as
        nodes join, until the wait is over (not for sandboxes bound to one node: `only`)."""
        try:
            return await attempt()
        except NO_ROOM:
            if not self.enabled or only is not None:
                raise
        deadline = time.monotonic() + self.wait_s
        self.waiting += 1
        self.membership.unrelease()  # idle nodes not yet gone are the quickest room
        try:
            await self._ask()
            while True:
                await asyncio.sleep(RETRY_SECONDS)
                try:
                    return await attempt()
                except NO_ROOM as exc:
                    if time.monotonic() >= deadline:
                        raise type(exc)(
                            f"{exc.message}: no node with room joined within "
                            f"{self.wait_s:g} s of asking Ray's autoscaler for one"
                        ) from None
        finally:
            self.waiting -= 1

    async def hold(self, names: Iterable[str]) -> None:
        """Nodes a sandbox is about to be made on are held before it is (a node that has
        just joined is idle until then)."""
        if not self.enabled:
            return
        for name in names:
            node = self.membership.nodes.get(name)
            if node is not None:
                self._idle_since.pop(name, None)
                await asyncio.to_thread(autoscaler.hold, node.node_id)

    async def status(self) -> FleetGrowth | None:
        if not self.enabled:
            return None
        held = await asyncio.to_thread(autoscaler.holds)
        names = {n.node_id: n.name for n in self.membership.nodes.values()}
        return FleetGrowth(
            waiting_creates=self.waiting,
            nodes_asked=self._asked,
            held_nodes=sorted(names.get(i, i) for i in held),
            released_nodes=sorted(names.get(i, i) for i in self.membership.released),
        )

    async def tend(self) -> None:
        await self._ask()
        await self._hold_busy_nodes()

    async def _ask(self) -> None:
        """While creates wait: one node more than the fleet has (a node that is up in Ray
        but still joining counts as the one asked for); otherwise no floor."""
        want = 0
        if self.waiting:
            alive = sum(n.alive for n in await asyncio.to_thread(cluster.nodes))
            want = max(alive, len(self.membership.healthy()) + 1)
        if want != self._asked:
            await asyncio.to_thread(autoscaler.ask, want)
            log.info("asked Ray's autoscaler for %d sandbox node(s)", want)
            self._asked = want

    async def _hold_busy_nodes(self) -> None:
        held = await asyncio.to_thread(autoscaler.holds)
        alive = {n.node_id for n in await asyncio.to_thread(cluster.nodes) if n.alive}
        for node_id in held - alive:  # a claim on a gone node would ask for a new one
            await asyncio.to_thread(autoscaler.release, node_id)
        now = time.monotonic()
        for node in self.membership.healthy():
            try:  # the node's own list: sandboxes it ended itself are gone from it
                listed = await node.json("GET", "/v1/sandboxes", params={"all_tenants": "true"})
            except errors.CellaError:
                continue  # unknown: held or not, it stays as it is
            if listed["sandboxes"] or node.name in self.planner.placing():
                self._idle_since.pop(node.name, None)
                if node.node_id not in held:
                    await asyncio.to_thread(autoscaler.hold, node.node_id)
                continue
            since = self._idle_since.setdefault(node.name, now)
            if now - since >= self.grace_s and not self.waiting:  # waiting: room for them
                await self.membership.release(node)
                await asyncio.to_thread(autoscaler.release, node.node_id)
                del self._idle_since[node.name]
