"""Which node daemons make up the fleet: found by polling Ray (`cluster.nodes()`, about once
a second), joined (their daemons started where needed, told the fleet's own addresses), and
lost when Ray reports them dead or gone (their sandboxes turn `lost`). Gateways sharing one
database each keep their own view of the nodes; the one holding the lease writes the losses."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit

from cella import errors
from cella.fleet import cluster
from cella.fleet.node_client import GATHER_TIMEOUT, Node
from cella.fleet.placement_table import Placements
from cella.network.interfaces import host_addresses
from cella.service.keys import Principal
from cella.store.sql import Lease

log = logging.getLogger("cella.fleet")
POLL_SECONDS = 1.0


class Membership:
    def __init__(
        self,
        address: str,
        allow_unauthenticated: bool,
        node_root: str,
        placements: Placements,
        on_join: Callable[[Node], Awaitable[None]],
        lease: Lease | None = None,
    ) -> None:
        # what follows a node's loss, given its name and the reason (replicas recovered)
        self.on_lost: Callable[[str, str], Coroutine[Any, Any, object]] | None = None
        self._after_loss: set[asyncio.Task[object]] = set()
        self.address = address
        self.allow_unauthenticated = allow_unauthenticated
        self.node_root = node_root
        self.placements = placements
        self.on_join = on_join  # what a node gets before it serves (the fleet's secrets)
        self.nodes: dict[str, Node] = {}
        self.failures: dict[str, str] = {}  # nodes that could not join, and why
        self._joining: set[str] = set()
        self.released: set[str] = set()  # NodeIDs let go to the autoscaler: never joined
        self._poller: asyncio.Task[None] | None = None
        self.lease = lease or Lease("", "membership")  # none given: this gateway alone
        self.leading = False  # whether this gateway writes the losses (the lease's holder)

    async def start(self) -> None:
        """Joins the cluster and every live node (and its daemon) before serving."""
        await asyncio.to_thread(cluster.connect, self.address, self.allow_unauthenticated)
        await self.poll(wait=True)
        self._poller = asyncio.create_task(self._poll_forever())

    async def shutdown(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        for node in self.nodes.values():
            await node.close()
        self.lease.close()

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
        leading = await asyncio.to_thread(self.lease.held)
        if leading != self.leading:
            log.warning("this gateway %s the fleet's losses", "writes" if leading else "leaves")
            self.leading = leading
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
            released = ray_node.node_id in self.released
            if not current and name not in self._joining and not released:
                self._joining.add(name)
                joins.append(asyncio.create_task(self._join(ray_node)))
        for name, node in self.nodes.items():
            now = alive.get(name)
            if node.node_id in self.released and (now is None or now.node_id != node.node_id):
                self.released.discard(node.node_id)
                node.reason = f"node {name} was released when idle and left the cluster"
            if node.healthy and (now is None or now.node_id != node.node_id):
                dead = any(n.node_id == node.node_id and not n.alive for n in found)
                self._lose(node, f"node {name} {'died' if dead else 'left the cluster'}")
        # nodes recorded before this gateway started that are gone from the cluster (the
        # gateway was down when they went): their sandboxes are lost all the same
        # (or that went while another gateway held the lease and died before writing it)
        for name in self.placements.holding() - alive.keys() if self.leading else ():
            reason = self._lose_sandboxes(name, f"node {name} is gone")
            if name not in self.nodes:
                self.failures.setdefault(name, reason)
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
            await self.on_join(node)
            await self._tell_fleet(node, await self._fleet_addresses(node))
            listed = await node.json("GET", "/v1/sandboxes", params={"all_tenants": "true"})
            for older in self.placements.resync(name, listed["sandboxes"]):
                await self._stop_older(node, older)
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

    async def _stop_older(self, node: Node, body: dict[str, Any]) -> None:
        """A returning node's copy of a sandbox that lives on elsewhere now (recovered
        from its replica meanwhile): stopped, so two copies never run; never routed to,
        its files left for the operator."""
        log.warning("node %s still had %s, which lives elsewhere now", node.name, body["id"])
        if body.get("state") in ("running", "paused"):
            who = Principal.service(str(body.get("tenant") or ""))
            path = f"/v1/sandboxes/{body['id']}/stop"
            try:  # its joining does not hang on it
                await node.json("POST", path, who, json={"memory": False})
            except errors.CellaError as exc:
                log.warning("%s on node %s was not stopped: %s", body["id"], node.name, exc)

    def _lose(self, node: Node, reason: str) -> None:
        node.healthy, node.reason = False, self._lose_sandboxes(node.name, reason)

    def _lose_sandboxes(self, name: str, reason: str) -> str:
        """Marks the node's sandboxes lost; returns the reason with its time."""
        dated = f"{reason} at {datetime.now(UTC).isoformat(timespec='seconds')}"
        if not self.leading:  # the gateway holding the lease writes it
            log.warning("%s", dated)
            return dated
        count = self.placements.lose(name, dated)
        log.warning("%s; %d sandboxes lost", dated, count)
        if count and self.on_lost is not None:
            task: asyncio.Task[object] = asyncio.get_running_loop().create_task(
                self.on_lost(name, dated)
            )
            self._after_loss.add(task)
            task.add_done_callback(self._after_loss.discard)
        return dated

    async def release(self, node: Node) -> None:
        """The node stops serving and its daemon ends, so that Ray's autoscaler may remove
        it (called for a node without sandboxes)."""
        self.released.add(node.node_id)
        node.healthy, node.reason = False, f"node {node.name} was released when idle"
        await asyncio.to_thread(cluster.stop_daemon, node.node_id)
        log.info("node %s released when idle", node.name)

    def unrelease(self) -> None:
        """Released nodes that are still up join again (demand came before they left)."""
        self.released.clear()

    def healthy(self) -> list[Node]:
        return [n for n in self.nodes.values() if n.healthy]

    def any_node(self) -> Node:
        nodes = self.healthy()
        if not nodes:
            raise errors.NodeUnavailable("no node of the fleet is up")
        return nodes[0]

    def up(self, name: str) -> Node | None:
        """The node called `name`, if it is up."""
        node = self.nodes.get(name)
        return node if node is not None and node.healthy else None

    async def each(self, method: str, path: str, who: Principal | None, **kw: Any) -> list[Any]:
        """The same call on every healthy node; (node, answer) pairs in node order. A read
        waits `GATHER_TIMEOUT` for each node: one that hangs fails it (`node_unavailable`,
        naming the node), not the minutes a long operation may take."""
        if method == "GET":
            kw.setdefault("timeout", GATHER_TIMEOUT)
        nodes = self.healthy()
        answers = await asyncio.gather(*(n.json(method, path, who, **kw) for n in nodes))
        return list(zip(nodes, answers, strict=True))
