"""New sandboxes on the fleet, by one pipeline whatever makes them (a create, a fork of a
snapshot, a LangSmith box): admitted against the tenant's quota (its name held), the
snapshot they boot from found, nodes planned and reserved, the snapshot (or the template)
shipped to each planned node that lacks it, then made there by the caller's `make` and
recorded where they are. Made on several nodes, they are all made or none is. Each made
sandbox is handed to `created` (the gateway replicates it if it or its tenant asks), so
every door (cella's, E2B's, LangSmith's; creates and forks) decides replication alike."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import ValidationError

from cella import errors
from cella.fleet.delegation import Delegations
from cella.fleet.growth import Growth
from cella.fleet.locator import Locator
from cella.fleet.membership import Membership
from cella.fleet.node_client import Node
from cella.fleet.planner import Planner, Shape
from cella.fleet.quotas import Quotas
from cella.fleet.rewrites import FleetRewrites
from cella.fleet.snapshots import FleetSnapshots
from cella.fleet.templates import FleetTemplates
from cella.fleet.volumes import FleetVolumes
from cella.models import SandboxCreate
from cella.server.error_shapes import describe
from cella.service.keys import Principal

Json = dict[str, Any]
# (the node, how many to make there, the snapshot's id or None) -> the sandboxes it made
Make = Callable[[Node, int, str | None], Awaitable[list[Json]]]


def shape_of(spec: SandboxCreate) -> Shape:
    return Shape(spec.vcpus, spec.memory_mib, spec.template)


class Launcher:
    def __init__(
        self,
        membership: Membership,
        locator: Locator,
        quotas: Quotas,
        planner: Planner,
        snapshots: FleetSnapshots,
        delegations: Delegations,
        rewrites: FleetRewrites,
        volumes: FleetVolumes,
        growth: Growth,
        templates: FleetTemplates,
    ) -> None:
        self.membership = membership
        self.locator = locator
        self.placements = locator.placements
        self.quotas = quotas
        self.planner = planner
        self.snapshots = snapshots
        self.delegations = delegations
        self.rewrites = rewrites
        self.volumes = volumes  # lends a sandbox's node the volumes it mounts
        self.growth = growth  # waits for a node when none has room, holds nodes in use
        # a sandbox just made (by any door), and whether it asked for a replica
        self.created: Callable[[Principal, Json, bool], None] = lambda _who, _body, _r: None
        self.templates = templates  # ships a template to a node that lacks it
        # a replicated sandbox whose replica keeps its memory while it runs (its id)
        self.keeps_memory: Callable[[str], None] = lambda _id: None

    async def launch(
        self,
        who: Principal,
        count: int,
        source: Shape | str,
        make: Make,
        *,
        name: str | None = None,
        holders: set[str] | None = None,
        prefer: str | None = None,
        only: str | None = None,
        replicate: bool = False,
    ) -> list[Json]:
        """`count` sandboxes made by `make` from `source` (a template's shape, or the
        snapshot they boot from: an id, name or name:tag; `holders` are nodes known to hold
        it besides those that answer for it), on the nodes that fit them best (`prefer`:
        the node asked for; `only`: the one node they may go to; `replicate`: asked for a
        replica, which a tenant of `replicate_tenants` gets without asking)."""
        async with self.quotas.admitted(who, count, name) as hold:
            snapshot_id = None
            held = set(holders or ())
            if isinstance(source, str):
                snap, found = await self.snapshots.resolve(who, source)
                snapshot_id, held = snap["id"], held | found
                source = Shape(snap["vcpus"], snap["memory_mib"], snap["template"])
            shape = source
            plan = await self.growth.plan(
                lambda: self.planner.plan(shape, count, held, prefer, only), only
            )
            with self.planner.reserve(plan, shape):
                await self.growth.hold(plan)

                async def part(name: str, n: int) -> tuple[Node, list[Json]]:
                    node = self.membership.nodes[name]
                    if snapshot_id is not None and name not in held:
                        await self.snapshots.ship(snapshot_id, held, node)
                    elif snapshot_id is None:
                        await self.templates.ensure_on(shape.template, node)
                    made = await make(node, n, snapshot_id)
                    for body in made:
                        self.placements.put(name, body)
                    hold.placed(len(made))  # counted from their records now
                    return node, made

                parts = await asyncio.gather(
                    *(part(name, n) for name, n in plan.items()), return_exceptions=True
                )
        failed = [p for p in parts if isinstance(p, BaseException)]
        done = [p for p in parts if not isinstance(p, BaseException)]
        if failed:  # all or nothing, as on one node
            for node, made in done:
                for body in made:
                    with contextlib.suppress(errors.CellaError):
                        await node.json("DELETE", f"/v1/sandboxes/{body['id']}", who)
                        self.placements.deleted(body["id"])
            raise failed[0]
        made = [body for _, bodies in done for body in bodies]
        for body in made:
            self.created(who, body, replicate)
        return made

    async def create(self, who: Principal, body: Json, prefer: str | None = None) -> Json:
        """cella's create (`POST /v1/sandboxes`), on the node that fits it best."""
        try:
            spec = SandboxCreate.model_validate(body)
        except ValidationError as exc:
            raise errors.InvalidArgument(describe(exc.errors())) from None

        grant = self.delegations.ask(who, spec.access_delegation)
        headers = {} if grant is None else self.delegations.header(grant)
        if "network" in body:  # rewrites to sandboxes anywhere in the fleet
            body = {**body, "network": await self.rewrites.settle(who, body["network"])}

        async def make(node: Node, n: int, snapshot_id: str | None) -> list[Json]:
            await self.volumes.lend(who, node, body.get("volume_mounts"))  # homes elsewhere
            # by id: a snapshot's names and tags live on the node it was taken on; a
            # replica is the gateway's to keep, not the node's
            sent = {k: v for k, v in body.items() if k not in ("replicate", "replicate_memory")}
            if snapshot_id is not None:
                sent["snapshot"] = snapshot_id
            made = await node.json("POST", "/v1/sandboxes", who, json=sent, headers=headers)
            if grant is not None:
                self.delegations.made(made["id"], who.tenant, grant)
            self.rewrites.record(made["id"], who, body.get("network"))
            return [made]

        source = spec.snapshot or shape_of(spec)
        # no network hop for a sandbox on its volume's home, unless another node is asked for
        prefer = prefer or await self.volumes.home_of(who, body.get("volume_mounts"))
        [created] = await self.launch(
            who, 1, source, make, name=spec.name, prefer=prefer, replicate=spec.replicate
        )
        if spec.replicate_memory:  # its replica keeps the running sandbox's memory too
            self.keeps_memory(str(created["id"]))
        return created

    async def fork_snapshot(
        self,
        who: Principal,
        ref: str,
        count: int,
        holders: set[str] | None = None,
        prefer: str | None = None,
        only: str | None = None,
    ) -> list[Json]:
        """`count` branches of a snapshot, on the nodes holding it where they fit, the rest
        on other nodes (the snapshot shipped there first); `only`: the one node they may
        go to."""

        async def make(node: Node, n: int, snapshot_id: str | None) -> list[Json]:
            path = f"/v1/snapshots/{snapshot_id}/fork"
            answer = await node.json("POST", path, who, json={"count": n})
            made = list(answer["sandboxes"])
            for body in made:  # the parent's rewrite rules, known here as its node knows them
                if body.get("parent_id"):
                    self.rewrites.inherit(body["id"], body["parent_id"])
            return made

        return await self.launch(who, count, ref, make, holders=holders, prefer=prefer, only=only)

    async def fork_sandbox(
        self, who: Principal, sandbox_id: str, count: int, prefer: str | None = None
    ) -> list[Json]:
        """`count` branches of a sandbox: a snapshot of it, forked; the snapshot (and
        copies shipped meanwhile) removed again if the fork is refused or fails."""
        where = await self.locator.placement(who, sandbox_id)
        node = self.locator.usable(where)
        only = node.name if where.body.get("volume_mounts") else None  # lent there
        snap = await node.json(
            "POST",
            f"/v1/sandboxes/{sandbox_id}/snapshots",
            who,
            json={"name": f"fork of {sandbox_id}"},
        )
        try:
            return await self.fork_snapshot(who, snap["id"], count, {node.name}, prefer, only)
        except BaseException:  # refused or failed whole: no snapshot left behind either
            with contextlib.suppress(errors.CellaError):
                await self.snapshots.delete(who, snap["id"])
            raise
