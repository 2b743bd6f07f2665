"""The fleet gateway's state and decisions: which node daemons exist (from Ray), where each
sandbox lives, where a new one goes, and snapshots shipped to where they are forked.

Nodes are found by polling Ray (`cluster.nodes()`, about once a second); a node that dies
or leaves turns its sandboxes `lost`. The gateway keeps no sandbox state of its own beyond
`Placements`, which it rebuilds from the nodes when it starts and when a node joins.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import ValidationError

from cella import errors
from cella.config import DaemonSettings
from cella.fleet import cluster
from cella.fleet.node_client import Node, raise_for
from cella.fleet.placement_policy import Candidate, spread
from cella.fleet.placement_table import Placement, Placements
from cella.models import Capacity, SandboxCreate
from cella.models.fleet import FleetNode, FleetStatus
from cella.models.network import SecretPut
from cella.network.interfaces import host_addresses
from cella.server.app import describe
from cella.service.evals import Evals
from cella.service.keys import Keys, Principal
from cella.service.sessions import Sessions
from cella.store import SecretRecord, Store, sealing
from cella.store.sealing import seal_store

log = logging.getLogger("cella.fleet")
POLL_SECONDS = 1.0
LIVE = {"creating", "running", "paused", "starting", "stopping"}


class Gateway:
    def __init__(self, settings: DaemonSettings, address: str, node_root: Path | None) -> None:
        os.umask(0o077)
        self.settings = settings
        self.address = address
        root = settings.data_dir
        root.mkdir(parents=True, exist_ok=True)
        self.store = Store(root / "gateway.db")
        self.secrets_key = seal_store(
            self.store,
            settings.secrets_key_file or root / "secrets.key",
            settings.secrets_key_command,
        )
        self.keys = Keys(self.store)
        self.keys.ensure_admin_key(root)
        self.sessions = Sessions(self.keys, root / "session.key")  # the web console's
        self.placements = Placements(root / "placements.db")
        self.evals = Evals(  # eval runs are recorded here, not on a node
            self.store, lambda sid: where.tenant if (where := self.placements.get(sid)) else None
        )
        self.node_root = str(node_root or root / "nodes")
        self.nodes: dict[str, Node] = {}
        self.failures: dict[str, str] = {}  # nodes that could not join, and why
        self._joining: set[str] = set()
        self._reserved: dict[str, list[tuple[int, int]]] = {}  # node -> (vCPUs, MiB) placing
        self._inflight: dict[str, int] = {}  # tenant -> sandboxes being made
        self._naming: set[tuple[str, str]] = set()  # (tenant, name) of creates under way
        self._quota_lock = asyncio.Lock()
        self._poller: asyncio.Task[None] | None = None

    # -- nodes -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Joins the cluster and every live node (and its daemon) before serving."""
        allow = self.settings.ray_allow_unauthenticated
        await asyncio.to_thread(cluster.connect, self.address, allow)
        await self.poll(wait=True)
        self._poller = asyncio.create_task(self._poll_forever())

    async def shutdown(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        for node in self.nodes.values():
            await node.close()

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(POLL_SECONDS)
            try:
                await self.poll()
            except Exception:  # Ray hiccups must not end the loop
                log.exception("polling the cluster failed")

    async def poll(self, wait: bool = False) -> None:
        """Nodes Ray reports alive join (their daemons started where needed); known nodes
        that Ray reports dead or no longer lists are lost."""
        found = await asyncio.to_thread(cluster.nodes)
        alive = {n.name: n for n in found if n.alive}
        joins = []
        for name, ray_node in alive.items():
            known = self.nodes.get(name)
            current = (
                known is not None
                and known.node_id == ray_node.node_id
                and known.healthy
                and not known.stale  # asked again where its daemon answers now
            )
            if not current and name not in self._joining:
                self._joining.add(name)
                joins.append(asyncio.create_task(self._join(ray_node)))
        for name, node in self.nodes.items():
            now = alive.get(name)
            if node.healthy and (now is None or now.node_id != node.node_id):
                dead = any(n.node_id == node.node_id and not n.alive for n in found)
                self._lose(node, f"node {name} {'died' if dead else 'left the cluster'}")
        # nodes recorded before this gateway started that are gone from the cluster (the
        # gateway was down when they went): their sandboxes are lost all the same
        for name in self.placements.holding() - alive.keys() - self.nodes.keys():
            self.failures.setdefault(name, self._lose_sandboxes(name, f"node {name} is gone"))
        if wait and joins:
            await asyncio.gather(*joins, return_exceptions=True)
        wanted = await self._fleet_addresses()
        for node in self.healthy():
            try:
                await self._tell_fleet(node, wanted)
            except Exception as exc:  # told again at the next poll
                log.warning("node %s was not told the fleet's addresses: %s", node.name, exc)

    async def _fleet_addresses(self, *joining: Node) -> list[str]:
        """Every Ray node's address, every node daemon's and the gateway host's own: no
        tenant's rule reaches them from a sandbox."""
        found = await asyncio.to_thread(cluster.addresses)
        found |= {str(a) for a in host_addresses()}
        found |= {urlsplit(n.url).hostname or "" for n in [*self.nodes.values(), *joining]}
        return sorted(found - {""})

    async def _tell_fleet(self, node: Node, wanted: list[str]) -> None:
        if node.told_addresses != wanted:
            await node.json("PUT", "/v1/egress/boundary/fleet", json={"addresses": wanted})
            node.told_addresses = wanted

    async def _join(self, ray_node: cluster.RayNode) -> None:
        name = ray_node.name
        try:
            info = await asyncio.to_thread(cluster.daemon_of, ray_node, self.node_root)
            if not info["alive"]:
                raise errors.NodeUnavailable(str(info.get("reason") or "its daemon is down"))
            node = Node(
                name, ray_node.node_id, info["url"], info["admin_key"], info.get("ca_pem", "")
            )
            node.restarts = int(info.get("restarts") or 0)
            await self._push_secrets(node)
            await self._tell_fleet(node, await self._fleet_addresses(node))
            listed = await node.json("GET", "/v1/sandboxes", params={"all_tenants": "true"})
            self.placements.resync(name, listed["sandboxes"])
            old = self.nodes.get(name)
            self.nodes[name] = node
            self.failures.pop(name, None)
            if old is not None:
                await old.close()
            log.info("node %s joined (%s, %d sandboxes)", name, node.url, len(listed["sandboxes"]))
        except Exception as exc:  # retried at the next poll
            self.failures[name] = f"{type(exc).__name__}: {exc}"
            log.warning("node %s could not join: %s", name, self.failures[name])
        finally:
            self._joining.discard(name)

    def _lose(self, node: Node, reason: str) -> None:
        node.healthy, node.reason = False, self._lose_sandboxes(node.name, reason)

    def _lose_sandboxes(self, name: str, reason: str) -> str:
        """Marks the node's sandboxes lost; returns the reason with its time."""
        dated = f"{reason} at {datetime.now(UTC).isoformat(timespec='seconds')}"
        count = self.placements.lose(name, dated)
        log.warning("%s; %d sandboxes lost", dated, count)
        return dated

    async def rotate_secrets_key(self) -> int:
        """A new key for the gateway's copy of the secrets, and for every node's; returns
        how many values the gateway resealed. A node that does not answer is an error (its
        old key would hold on)."""
        resealed = sealing.rotate(self.secrets_key, self.store)
        for node in self.healthy():
            await node.json("POST", "/v1/secrets-key/rotate")
        return resealed

    def healthy(self) -> list[Node]:
        return [n for n in self.nodes.values() if n.healthy]

    def any_node(self) -> Node:
        nodes = self.healthy()
        if not nodes:
            raise errors.NodeUnavailable("no node of the fleet is up")
        return nodes[0]

    async def each(self, method: str, path: str, who: Principal | None, **kw: Any) -> list[Any]:
        """The same call on every healthy node; (node, answer) pairs in node order."""
        nodes = self.healthy()
        answers = await asyncio.gather(*(n.json(method, path, who, **kw) for n in nodes))
        return list(zip(nodes, answers, strict=True))

    # -- where sandboxes are -----------------------------------------------------------------

    async def placement(self, who: Principal, sandbox_id: str) -> Placement:
        """The tenant's sandbox, wherever it is (nodes asked if the gateway has not seen it)."""
        found = self.placements.get(sandbox_id)
        if found is None:
            for node in self.healthy():
                response = await node.call("GET", f"/v1/sandboxes/{sandbox_id}", who)
                if response.status_code == 200:
                    self.placements.put(node.name, response.json())
                    found = self.placements.get(sandbox_id)
                    break
        if found is None or found.tenant != who.tenant:
            raise errors.NotFound(f"no sandbox {sandbox_id!r}")
        return found

    async def placement_named(self, who: Principal, name: str) -> Placement:
        """The tenant's sandbox called `name` (the LangSmith API addresses boxes by name)."""
        for attempt in range(2):
            for found in self.placements.of_tenant(who.tenant):
                if found.body.get("name") == name and found.body.get("state") != "deleted":
                    return found
            if attempt == 0:  # not seen yet: ask the nodes
                await self.list_sandboxes(who, [])
        raise errors.NotFound(f"no sandbox named {name!r}")

    def usable(self, where: Placement) -> Node:
        if where.lost:
            raise errors.SandboxLost(f"sandbox {where.sandbox_id} is lost: {where.lost}")
        node = self.nodes.get(where.node)
        if node is None or not node.healthy:
            raise errors.NodeUnavailable(f"node {where.node} of {where.sandbox_id} is down")
        return node

    async def node_of(self, who: Principal, sandbox_id: str) -> Node:
        return self.usable(await self.placement(who, sandbox_id))

    async def list_sandboxes(self, who: Principal, params: list[tuple[str, str]]) -> list[Any]:
        found: list[dict[str, Any]] = []
        for node, answer in await self.each("GET", "/v1/sandboxes", who, params=params):
            for body in answer["sandboxes"]:
                self.placements.put(node.name, body)
                found.append(body)
        state = dict(params).get("state")
        if state in (None, "lost"):
            labels = [v for k, v in params if k == "label"]
            for lost in self.placements.lost(who.tenant):
                shown = lost.shown()
                have = shown.get("labels") or {}
                if all(have.get(k) == v for k, _, v in (p.partition("=") for p in labels)):
                    found.append(shown)
        if state is not None:
            found = [b for b in found if b.get("state") == state]
        return sorted(found, key=lambda b: str(b.get("created_at")))

    # -- placing new sandboxes ---------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def admitted(self, who: Principal, count: int, name: str | None = None) -> Any:
        """Holds `count` of the tenant's cluster-wide quota while they are being made; a
        `name` must be free across the fleet (and is held meanwhile)."""
        async with self._quota_lock:
            live = 0  # sandboxes being made are counted once: as this gateway's, in flight
            for _, answer in await self.each("GET", "/v1/sandboxes", who):
                live += sum(1 for b in answer["sandboxes"] if b["state"] in LIVE - {"creating"})
                if name and any(b.get("name") == name for b in answer["sandboxes"]):
                    raise errors.AlreadyExists(f"a sandbox named {name!r} exists")
            if name and (who.tenant, name) in self._naming:
                raise errors.AlreadyExists(f"a sandbox named {name!r} is being made")
            limit = self.settings.max_sandboxes_per_tenant
            if live + self._inflight.get(who.tenant, 0) + count > limit:
                raise errors.QuotaExceeded(
                    f"tenant {who.tenant} has {live} live sandboxes in the fleet; "
                    f"the limit is {limit}"
                )
            self._inflight[who.tenant] = self._inflight.get(who.tenant, 0) + count
            if name:
                self._naming.add((who.tenant, name))
        try:
            yield
        finally:
            self._inflight[who.tenant] -= count
            self._naming.discard((who.tenant, name or ""))

    @contextlib.contextmanager
    def reserve(self, plan: dict[str, int], vcpus: int, memory_mib: int) -> Iterator[None]:
        """What is being placed counts against a node until its daemon has it."""
        held = [(name, (vcpus * n, memory_mib * n)) for name, n in plan.items()]
        for name, amount in held:
            self._reserved.setdefault(name, []).append(amount)
        try:
            yield
        finally:
            for name, amount in held:
                self._reserved[name].remove(amount)

    async def plan(
        self,
        vcpus: int,
        memory_mib: int,
        count: int,
        holders: set[str],
        template: str,
        prefer: str | None = None,
    ) -> dict[str, int]:
        nodes = self.healthy()
        if not nodes:
            raise errors.NodeUnavailable("no node of the fleet is up")
        reports = await asyncio.gather(
            *(n.json("GET", "/v1/capacity") for n in nodes),
            *(n.json("GET", "/v1/health") for n in nodes),
            *(n.json("GET", "/v1/templates") for n in nodes),
        )
        candidates = []
        for i, node in enumerate(nodes):
            capacity = Capacity.model_validate(reports[i])
            pool: dict[str, int] = reports[len(nodes) + i].get("pool") or {}
            built = {t["name"] for t in reports[2 * len(nodes) + i]["templates"] if t["built"]}
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
                    has_template=template in built,
                )
            )
        plan = spread(candidates, vcpus, memory_mib, count)
        if not plan:
            raise errors.CapacityExceeded(
                f"the fleet has no room for {count} sandbox(es) of {vcpus} vCPUs and "
                f"{memory_mib} MiB"
            )
        return plan

    async def create(
        self, who: Principal, body: dict[str, Any], prefer: str | None = None
    ) -> dict[str, Any]:
        try:
            spec = SandboxCreate.model_validate(body)
        except ValidationError as exc:
            raise errors.InvalidArgument(describe(exc.errors())) from None
        async with self.admitted(who, 1, spec.name):
            if spec.snapshot:
                snap, holders = await self.resolve_snapshot(who, spec.snapshot)
                body = {**body, "snapshot": snap["id"]}  # tags live on the snapshot's origin
                vcpus, memory, template = snap["vcpus"], snap["memory_mib"], snap["template"]
            else:
                snap, holders = None, set()
                vcpus, memory, template = spec.vcpus, spec.memory_mib, spec.template
            plan = await self.plan(vcpus, memory, 1, holders, template, prefer)
            [name] = plan
            node = self.nodes[name]
            with self.reserve(plan, vcpus, memory):
                if snap is not None and name not in holders:
                    await self.ship(snap["id"], holders, node)
                created: dict[str, Any] = await node.json("POST", "/v1/sandboxes", who, json=body)
            self.placements.put(name, created)
            return created

    # -- snapshots across nodes --------------------------------------------------------------

    async def resolve_snapshot(self, who: Principal, ref: str) -> tuple[dict[str, Any], set[str]]:
        """The snapshot `ref` names (the newest answer if nodes differ), and the nodes
        holding it."""
        answers = []
        for node in self.healthy():
            response = await node.call("GET", f"/v1/snapshots/{ref}", who)
            if response.status_code == 200:
                answers.append((node.name, response.json()))
        if not answers:
            raise errors.NotFound(f"no snapshot {ref!r}")
        chosen = max((a for _, a in answers), key=lambda a: str(a["created_at"]))
        if chosen["state"] != "ready":
            raise errors.InvalidState(f"snapshot {chosen['id']} is {chosen['state']}")
        return chosen, {name for name, a in answers if a["id"] == chosen["id"]}

    async def snapshot_id(self, who: Principal, ref: str) -> str:
        """The id of the caller's snapshot `ref`, wherever in the fleet it is."""
        snap, _ = await self.resolve_snapshot(who, ref)
        return str(snap["id"])

    async def ship(self, snapshot_id: str, holders: set[str], dest: Node) -> None:
        """Has `dest` pull the snapshot from a node that holds it (once: then it is cached)."""
        sources = [self.nodes[h] for h in sorted(holders) if self.nodes[h].healthy]
        if not sources:
            raise errors.NodeUnavailable(f"no node holding snapshot {snapshot_id} is up")
        source = sources[0]
        await dest.json(
            "POST",
            "/v1/snapshots/import",
            json={
                "source_url": source.url,
                "source_key": source.key,
                "source_ca": source.ca_pem or None,
                "snapshot_id": snapshot_id,
            },
        )

    async def fork_snapshot(
        self,
        who: Principal,
        ref: str,
        count: int,
        holders: set[str] | None = None,
        prefer: str | None = None,
    ) -> list[dict[str, Any]]:
        """`count` branches of a snapshot, on the nodes holding it where they fit, the rest
        on other nodes (the snapshot shipped there first)."""
        snap, found = await self.resolve_snapshot(who, ref)
        holders = found | (holders or set())
        async with self.admitted(who, count):
            vcpus, memory = snap["vcpus"], snap["memory_mib"]
            plan = await self.plan(vcpus, memory, count, holders, snap["template"], prefer)
            with self.reserve(plan, vcpus, memory):

                async def part(name: str, n: int) -> list[dict[str, Any]]:
                    node = self.nodes[name]
                    if name not in holders:
                        await self.ship(snap["id"], holders, node)
                    answer = await node.json(
                        "POST", f"/v1/snapshots/{snap['id']}/fork", who, json={"count": n}
                    )
                    for body in answer["sandboxes"]:
                        self.placements.put(name, body)
                    return list(answer["sandboxes"])

                parts = await asyncio.gather(
                    *(part(name, n) for name, n in plan.items()), return_exceptions=True
                )
        failed = [p for p in parts if isinstance(p, BaseException)]
        made = [b for p in parts if not isinstance(p, BaseException) for b in p]
        if failed:  # all or nothing, as on one node
            for body in made:
                with contextlib.suppress(errors.CellaError):
                    node = await self.node_of(who, body["id"])
                    await node.json("DELETE", f"/v1/sandboxes/{body['id']}", who)
                    self.placements.deleted(body["id"])
            raise failed[0]
        return made

    async def fork_sandbox(
        self, who: Principal, sandbox_id: str, count: int, prefer: str | None = None
    ) -> list[Any]:
        node = await self.node_of(who, sandbox_id)
        snap = await node.json(
            "POST",
            f"/v1/sandboxes/{sandbox_id}/snapshots",
            who,
            json={"name": f"fork of {sandbox_id}"},
        )
        try:
            return await self.fork_snapshot(who, snap["id"], count, {node.name}, prefer)
        except BaseException:  # refused or failed whole: no snapshot left behind either
            with contextlib.suppress(errors.CellaError):
                await self.delete_snapshot(who, snap["id"])  # and copies shipped meanwhile
            raise

    async def list_snapshots(self, who: Principal, all_tenants: bool = False) -> list[Any]:
        seen: dict[str, dict[str, Any]] = {}
        params = {"all_tenants": "true"} if all_tenants else {}
        for _, answer in await self.each("GET", "/v1/snapshots", who, params=params):
            for body in answer["snapshots"]:
                seen.setdefault(body["id"], body)
        return sorted(seen.values(), key=lambda b: str(b["created_at"]))

    async def delete_snapshot(self, who: Principal, snapshot_id: str) -> None:
        """Removed from every node holding it (refused while one of them uses it)."""
        holders = [
            n
            for n in self.healthy()
            if (await n.call("GET", f"/v1/snapshots/{snapshot_id}", who)).status_code == 200
        ]
        if not holders:
            raise errors.NotFound(f"no snapshot {snapshot_id!r}")
        for node in holders:
            await node.json("DELETE", f"/v1/snapshots/{snapshot_id}", who)

    # -- secrets: kept here, and on every node (a sandbox may be placed on any) ------------

    async def put_secret(self, who: Principal, name: str, body: SecretPut) -> None:
        self.store.put_secret(
            SecretRecord(
                who.tenant, name, body.value, body.hosts, body.auth, body.username, body.inject
            )
        )
        await self.each("PUT", f"/v1/secrets/{name}", who, json=body.model_dump())

    async def delete_secret(self, who: Principal, name: str) -> None:
        if not self.store.delete_secret(who.tenant, name):
            raise errors.NotFound(f"no secret {name!r}")
        for node in self.healthy():
            answer = await node.call("DELETE", f"/v1/secrets/{name}", who)
            if answer.status_code != 404:  # a node that joined after a failed push
                raise_for(answer, node.name)

    async def _push_secrets(self, node: Node) -> None:
        """A joining node gets every tenant's secrets (their values stay write-only)."""
        for record in self.store.list_secrets(None):
            body = SecretPut.model_validate(
                {
                    "value": record.value,
                    "hosts": record.hosts,
                    "auth": record.auth,
                    "username": record.username or "x-access-token",
                    "inject": record.inject,
                }
            )
            who = Principal(tenant=record.tenant, admin=False)
            await node.json("PUT", f"/v1/secrets/{record.name}", who, json=body.model_dump())

    # -- the fleet as a whole ----------------------------------------------------------------

    async def capacity(self) -> Capacity:
        parts = [
            Capacity.model_validate(a) for _, a in await self.each("GET", "/v1/capacity", None)
        ]
        return Capacity(
            memory_mib=sum(p.memory_mib for p in parts),
            memory_mib_committed=sum(p.memory_mib_committed for p in parts),
            vcpus=sum(p.vcpus for p in parts),
            vcpus_committed=sum(p.vcpus_committed for p in parts),
            live_sandboxes=sum(p.live_sandboxes for p in parts),
        )

    async def status(self) -> FleetStatus:
        async def one(node: Node) -> FleetNode:
            shown = FleetNode(
                name=node.name,
                node_id=node.node_id,
                url=node.url,
                healthy=node.healthy,
                reason=node.reason,
                sandboxes=sum(
                    1
                    for p in self.placements.on_node(node.name)
                    if not p.lost and p.body.get("state") != "deleted"
                ),
            )
            if not node.healthy:
                return shown
            try:
                capacity, health, snaps, templates = await asyncio.gather(
                    node.json("GET", "/v1/capacity"),
                    node.json("GET", "/v1/health"),
                    node.json("GET", "/v1/snapshots", params={"all_tenants": "true"}),
                    node.json("GET", "/v1/templates"),
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
                    "templates": [
                        t["name"] for t in templates["templates"] if t.get("built", True)
                    ],
                }
            )

        shown = list(await asyncio.gather(*(one(n) for n in self.nodes.values())))
        for name, reason in sorted(self.failures.items()):
            if name not in self.nodes:
                shown.append(FleetNode(name=name, node_id="", healthy=False, reason=reason))
        return FleetStatus(nodes=shown, lost_sandboxes=len(self.placements.lost()))
