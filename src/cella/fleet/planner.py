"""Which nodes new sandboxes go to: each healthy node's report (capacity, warm pool, built
templates) less what is being placed there right now, given to the placement policy; a
template the gateway can ship (`shippable`) counts as placeable on every node. A large
fleet is sampled: a placement asks 64 nodes (and those it must see), not every node. A node
whose daemon does not answer within `REPORT_TIMEOUT_S` (it hangs, refuses, is overloaded)
is placed around, and left out for a while (`answering.py`) instead of waited for again."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from cella import errors
from cella.fleet.answering import Answering
from cella.fleet.cordons import Cordons
from cella.fleet.membership import Membership
from cella.fleet.node_client import Node
from cella.fleet.placement_policy import Candidate, spread
from cella.models import Capacity

SAMPLE = 64  # nodes asked for their reports per placement, at most (past the wanted ones)
REPORT_TIMEOUT_S = 5.0  # a node's reports wait this long at most: a create never hangs on one


@dataclass(frozen=True, slots=True)
class Shape:
    """What one new sandbox needs of a node."""

    vcpus: int
    memory_mib: int
    template: str


class Planner:
    def __init__(
        self,
        membership: Membership,
        cordons: Cordons | None = None,
        shippable: Callable[[str], bool] = lambda _: False,
        answering: Answering | None = None,
    ) -> None:
        self.membership = membership
        self.answering = answering or Answering()  # nodes that did not answer, left out
        self.cordons = cordons  # nodes that take nothing new
        self.shippable = shippable  # templates the gateway can ship to a node lacking them
        self._reserved: dict[str, list[tuple[int, int]]] = {}  # node -> (vCPUs, MiB) placing

    @contextlib.contextmanager
    def reserve(self, plan: dict[str, int], shape: Shape) -> Iterator[None]:
        """What is being placed counts against a node until its daemon has it."""
        held = [(name, (shape.vcpus * n, shape.memory_mib * n)) for name, n in plan.items()]
        for name, amount in held:
            self._reserved.setdefault(name, []).append(amount)
        try:
            yield
        finally:
            for name, amount in held:
                self._reserved[name].remove(amount)

    def placing(self) -> set[str]:
        """The nodes sandboxes are being placed on right now."""
        return {name for name, held in self._reserved.items() if held}

    async def plan(
        self,
        shape: Shape,
        count: int,
        holders: set[str],
        prefer: str | None = None,
        only: str | None = None,
        exclude: frozenset[str] = frozenset(),
    ) -> dict[str, int]:
        """node -> how many of the `count` sandboxes go there (`holders`: the nodes holding
        the snapshot they boot from; `prefer`: the node asked for; `only`: the one node
        they may go to, the home of the volumes they mount; `exclude`: nodes they may not
        go to, besides the cordoned ones: a replica's never goes to its sandbox's own)."""
        if only is not None and self.cordons is not None and only in self.cordons:
            raise errors.InvalidState(f"node {only} is cordoned: nothing new is placed there")
        out = exclude | (self.cordons.names() if self.cordons is not None else set())
        nodes = [
            n
            for n in self.membership.healthy()
            if (only is None or n.name == only) and n.name not in out
        ]
        if not nodes:
            raise errors.NodeUnavailable(
                "no node of the fleet is up and open to new sandboxes"
                if only is None
                else f"node {only} is down"
            )
        silent = self.answering.left_out()
        # the nodes that answered lately; none of them: every node asked again
        nodes = [n for n in nodes if n.name not in silent] or nodes
        asked = sample(nodes, SAMPLE, {*holders, prefer or ""})
        whole = len(asked) == len(nodes)
        plan = await self._plan(asked, shape, count, holders, prefer, whole)
        if plan is None and not whole:  # not in the sample: every node asked (that answers)
            silent = self.answering.left_out()
            rest = [n for n in nodes if n.name not in silent]
            if not rest:
                raise errors.NodeUnavailable("no node of the fleet answered")
            plan = await self._plan(rest, shape, count, holders, prefer, True)
        if not plan:
            raise errors.CapacityExceeded(
                f"the fleet has no room for {count} sandbox(es) of {shape.vcpus} vCPUs and "
                f"{shape.memory_mib} MiB"
            )
        return plan

    async def _plan(
        self,
        nodes: list[Node],
        shape: Shape,
        count: int,
        holders: set[str],
        prefer: str | None,
        whole: bool,
    ) -> dict[str, int] | None:
        """The plan over `nodes` from their reports (a node that does not answer left out);
        None if none of them has room, or (a sample, not the `whole` fleet) none has the
        template built where the gateway cannot ship it. Where no node of the fleet has
        it, it goes by room, and the node says what is missing."""
        reports = await asyncio.gather(*(self._report(n) for n in nodes))
        answered = [(n, r) for n, r in zip(nodes, reports, strict=True) if r is not None]
        if not answered and not whole:
            return None  # the rest of the fleet is asked
        if not answered:
            reasons = "; ".join(f"{n.name}: {self.answering.reason(n.name)}" for n in nodes)
            raise errors.NodeUnavailable(f"no node of the fleet answered ({reasons})")
        vcpus, memory_mib, template = shape.vcpus, shape.memory_mib, shape.template
        ships = self.shippable(template)
        candidates, unheld = [], []
        for node, (capacity, health, templates) in answered:
            pool: dict[str, int] = health.get("pool") or {}
            built = {t["name"] for t in templates["templates"] if t["built"]}
            held_cpus = sum(c for c, _ in self._reserved.get(node.name, []))
            held_memory = sum(m for _, m in self._reserved.get(node.name, []))
            candidates.append(
                Candidate(
                    name=node.name,
                    memory_mib_free=capacity.memory_mib_free - held_memory,
                    vcpus_free=capacity.vcpus_free - held_cpus,
                    holds_snapshot=node.name in holders,
                    pooled_template=pool.get(f"{template}/{vcpus}/{memory_mib}", 0) > 0,
                    preferred=node.name == prefer,
                    has_template=template in built or ships,
                    ships_template=template not in built and ships,
                )
            )
            unheld.append(
                replace(
                    candidates[-1],
                    memory_mib_free=capacity.memory_mib_free,
                    vcpus_free=capacity.vcpus_free,
                )
            )
        if not whole and not any(c.has_template for c in candidates):
            return None  # maybe built on a node not asked
        # What is held for creates in flight may be in the node's report already (admitted
        # there, not yet answered): counted twice, a burst would be refused room it has. So
        # without the holds, the node's own admission decides (it queues briefly or refuses).
        return (
            spread(candidates, vcpus, memory_mib, count)
            or spread(unheld, vcpus, memory_mib, count)
            or None
        )

    async def _report(self, node: Node) -> tuple[Capacity, Any, Any] | None:
        """The node's capacity, health and templates; None if it did not answer in time
        (or answered nonsense): it is left out of placements for a while."""

        async def asked() -> tuple[Capacity, Any, Any]:
            capacity, health, templates = await asyncio.wait_for(
                asyncio.gather(
                    node.json("GET", "/v1/capacity"),
                    node.json("GET", "/v1/health"),
                    node.json("GET", "/v1/templates"),
                ),
                REPORT_TIMEOUT_S,
            )
            return Capacity.model_validate(capacity), health, templates

        return await self.answering.ask(node.name, asked)


def sample(nodes: list[Node], most: int, wanted: set[str]) -> list[Node]:
    """The nodes a placement asks: every one up to `most`, else the `wanted` ones (asked
    for, holding the snapshot) and a random sample of the rest: a create's cost stays
    flat as the fleet grows, and the freest of 64 random nodes is among the freest few
    percent of the fleet (every node is asked when the sample has no room)."""
    if len(nodes) <= most:
        return nodes
    must = [n for n in nodes if n.name in wanted]
    rest = [n for n in nodes if n.name not in wanted]
    return must + random.sample(rest, max(0, min(len(rest), most - len(must))))
