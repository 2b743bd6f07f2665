"""Templates on a fleet: built once, on one node, and shipped by content digest to the
nodes that need them; never built again.

An image build (`POST /v1/templates`) or a Dockerfile build runs on one healthy node (the
one asked for with `X-Cella-Node`, else the first), its progress streamed back as JSON
Lines naming that node; once it is `done` the gateway records the node as the template's
source. A sandbox of it placed on a node that lacks it has the template shipped there first
(`ensure_on`: the node pulls the base from a node that holds it and checks it against its
SHA-256; a copy that does not match is deleted there and the next holder is tried, else the
create fails with `template_corrupt`); `POST /v1/templates/{name}/ship` ships it ahead of
time, and a node that joins later is shipped every template recorded here in the
background. The list is every node's, a template built where any node holds it; a removal
is every node's."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import IO, Any

import httpx2

from cella import errors
from cella.fleet.membership import Membership
from cella.fleet.node_client import Node, raise_for
from cella.models import TemplateBuild
from cella.store.sql import Database, database

log = logging.getLogger("cella.fleet.templates")
SCHEMA = """
CREATE TABLE IF NOT EXISTS fleet_templates (
    name TEXT PRIMARY KEY,
    node TEXT NOT NULL,
    builds INTEGER NOT NULL DEFAULT 0,
    ships INTEGER NOT NULL DEFAULT 0,
    sha256 TEXT
);
"""
Json = dict[str, Any]
# the build on the node chosen: the request made there, streamed
Send = Callable[[Node], Awaitable[httpx2.Response]]


class FleetTemplates:
    def __init__(self, where: Path | str | Database, membership: Membership) -> None:
        self.membership = membership
        self._db = database(where)
        self._db.ensure("fleet_templates", SCHEMA)
        self._tasks: set[asyncio.Task[Any]] = set()  # builds outlive their callers
        self._shipping: dict[tuple[str, str], asyncio.Lock] = {}  # (template, node)

    # -- the record ---------------------------------------------------------------------------

    def source_of(self, name: str) -> str | None:
        """The node a template built through the gateway was built on (None: not one)."""
        row = self._db.execute(
            "SELECT node FROM fleet_templates WHERE name = ?", (name,)
        ).fetchone()
        return str(row[0]) if row else None

    def counts(self, name: str) -> tuple[int, int]:
        """How many times the template was built, and shipped, through the gateway."""
        row = self._db.execute(
            "SELECT builds, ships FROM fleet_templates WHERE name = ?", (name,)
        ).fetchone()
        return (int(row[0]), int(row[1])) if row else (0, 0)

    def shippable(self, name: str) -> bool:
        return self.source_of(name) is not None

    def digest_of(self, name: str) -> str | None:
        """The SHA-256 of the template's base as last built (a node holding another, an
        older build's, is shipped this one)."""
        row = self._db.execute(
            "SELECT sha256 FROM fleet_templates WHERE name = ?", (name,)
        ).fetchone()
        return str(row[0]) if row and row[0] else None

    def _built(self, name: str, node: str, sha256: str | None) -> None:
        self._db.execute(
            "INSERT INTO fleet_templates (name, node, builds, sha256) VALUES (?, ?, 1, ?) "
            "ON CONFLICT (name) DO UPDATE SET node = excluded.node, "
            "builds = fleet_templates.builds + 1, "
            "sha256 = excluded.sha256",
            (name, node, sha256),
        )

    # -- builds -------------------------------------------------------------------------------

    def build_image(self, body: TemplateBuild, prefer: str | None = None) -> AsyncIterator[bytes]:
        """An image build on one node, recorded as the template's source once done."""
        sent = body.model_dump(mode="json", exclude_unset=True)

        def send(node: Node) -> Awaitable[httpx2.Response]:
            request = node.client.build_request(
                "POST", "/v1/templates", json=sent, headers=node.headers(None)
            )
            return node.client.send(request, stream=True)

        return self._once(self._builder(prefer), send, lambda _: None)

    def build_dockerfile(
        self, name: str, query: str, spool: IO[bytes], prefer: str | None = None
    ) -> AsyncIterator[bytes]:
        """A Dockerfile build on one node, sent the spooled context."""

        async def context() -> AsyncIterator[bytes]:
            offset = 0  # pread: the file's offset is not ours alone
            while chunk := await asyncio.to_thread(os.pread, spool.fileno(), 1 << 20, offset):
                offset += len(chunk)
                yield chunk

        def send(node: Node) -> Awaitable[httpx2.Response]:
            request = node.client.build_request(
                "POST",
                f"/v1/templates/{name}/dockerfile",
                params=query,
                content=context(),
                headers={**node.headers(None), "content-type": "application/x-tar"},
            )
            return node.client.send(request, stream=True)

        try:
            node = self._builder(prefer)
        except BaseException:
            spool.close()
            raise
        return self._once(node, send, lambda _: spool.close())

    def _builder(self, prefer: str | None) -> Node:
        nodes = self.membership.healthy()
        if not nodes:
            raise errors.NodeUnavailable("no node of the fleet is up")
        if prefer is not None:
            chosen = [n for n in nodes if n.name == prefer]
            if not chosen:
                raise errors.NodeUnavailable(f"node {prefer} is not up")
            return chosen[0]
        return min(nodes, key=lambda n: n.name)

    def _once(self, node: Node, send: Send, on_end: Callable[[bool], None]) -> AsyncIterator[bytes]:
        """The build `send` starts on `node`, run as the gateway's own task (a client that
        goes away does not stop it); its progress, then its outcome (`done` recorded)."""
        queue: asyncio.Queue[Json | None] = asyncio.Queue()

        async def outcome() -> Json:
            try:
                answer = await send(node)
            except httpx2.TransportError as exc:
                return {"type": "error", "code": "node_unavailable",
                        "message": f"node {node.name} does not answer: {exc}"}  # fmt: skip
            try:
                if not answer.is_success:
                    await answer.aread()
                    try:
                        raise_for(answer, node.name)
                    except errors.CellaError as exc:
                        return {"type": "error", "code": exc.code, "message": exc.message}
                last: Json = {"type": "error", "code": "node_unavailable",
                              "message": f"node {node.name} ended the build unsaid"}  # fmt: skip
                async for line in answer.aiter_lines():
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    if event.get("type") == "progress":
                        queue.put_nowait({**event, "message": f"[{node.name}] {event['message']}"})
                    else:
                        last = event
                return last
            finally:
                await answer.aclose()

        async def run() -> None:
            done = False
            try:
                end = await outcome()
                done = end["type"] == "done"
                if done:
                    built = end["template"]
                    self._built(str(built["name"]), node.name, built.get("sha256"))
                    end = {**end, "template": {**end["template"], "nodes": [node.name]}}
                else:
                    end = {**end, "message": f"node {node.name}: {end.get('message')}"}
                queue.put_nowait(end)
            finally:
                on_end(done)
                queue.put_nowait(None)

        self._start(run())

        async def lines() -> AsyncIterator[bytes]:
            while (event := await queue.get()) is not None:
                yield json.dumps(event, separators=(",", ":")).encode() + b"\n"

        return lines()

    def _start(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- shipping -----------------------------------------------------------------------------

    async def ensure_on(self, name: str, node: Node) -> None:
        """A template built through the gateway, shipped to `node` unless it holds it
        (built-in templates are every node's own; E2B's named ones stay on their home)."""
        if not self.shippable(name):
            return
        lock = self._shipping.setdefault((name, node.name), asyncio.Lock())
        async with lock:  # creates placed there at once: one ship
            answer = await node.call("GET", f"/v1/templates/{name}")
            want = self.digest_of(name)
            if answer.status_code == 200:
                held = answer.json()
                if held.get("built") and want in (None, held.get("sha256")):
                    return
            await self.ship(name, node)

    async def ship(self, name: str, dest: Node) -> Json:
        """`dest` pulls the template from a node that holds it (its source first), checked
        against its digest there; a source whose copy is refused is followed by the next."""
        source = self.source_of(name)
        if source is None:
            raise errors.NotFound(f"no template {name!r} built through the fleet's gateway")
        nodes = sorted(
            (n for n in self.membership.healthy() if n.name != dest.name),
            key=lambda n: (n.name != source, n.name),
        )
        failure: errors.CellaError = errors.NodeUnavailable(
            f"no node holding template {name!r} is up"
        )
        for holder in nodes:
            try:
                got = await dest.json(
                    "POST",
                    "/v1/templates/import",
                    json={
                        **holder.as_source(),
                        "source_node": holder.name,
                        "name": name,
                    },
                )
            except (errors.NotFound, errors.ImageMissing, errors.NodeUnavailable) as exc:
                failure = exc if holder.name == source else failure
                continue
            except errors.TemplateCorrupt as exc:
                log.error("template %s from %s refused by %s: %s", name, holder.name,
                          dest.name, exc.message)  # fmt: skip
                failure = exc
                continue
            self._db.execute("UPDATE fleet_templates SET ships = ships + 1 WHERE name = ?", (name,))
            log.info("template %s shipped from %s to %s", name, holder.name, dest.name)
            return dict(got)
        raise failure

    async def ship_ahead(self, name: str, nodes: list[str] | None) -> list[Json]:
        """Shipped now to `nodes` (None: every healthy node) that lack it."""
        if self.source_of(name) is None:
            raise errors.NotFound(f"no template {name!r} built through the fleet's gateway")
        healthy = {n.name: n for n in self.membership.healthy()}
        missing = [n for n in nodes or [] if n not in healthy]
        if missing:
            raise errors.NodeUnavailable(f"node {', '.join(missing)} is not up")
        targets = [healthy[n] for n in nodes] if nodes else list(healthy.values())
        for node in targets:
            await self.ensure_on(name, node)
        return [{"node": n.name, "built": True} for n in targets]

    async def push_to(self, node: Node) -> None:
        """A joining node is shipped, in the background, the templates recorded here."""
        names = [r[0] for r in self._db.execute("SELECT name FROM fleet_templates")]
        if not names:
            return

        async def ship() -> None:
            for name in names:
                try:
                    await self.ensure_on(name, node)
                except Exception as exc:  # shipped on placement instead
                    log.warning("template %s to joining node %s: %s", name, node.name, exc)

        self._start(ship())

    # -- the list, and removal ---------------------------------------------------------------

    async def listed(self, tenant: str | None) -> list[Json]:
        """Every node's templates (a tenant's own and the shared ones), each once: built
        where any node holds it, with the nodes that hold it (and, for one built through
        the gateway, the node it was built on and how often it was built and shipped)."""
        seen: dict[str, Json] = {}
        for node, answer in await self.membership.each("GET", "/v1/templates", None):
            for t in answer["templates"]:
                if tenant is not None and t.get("tenant") not in (None, tenant):
                    continue
                have = seen.setdefault(t["name"], {**t, "built": False, "nodes": []})
                if t["built"]:
                    fields = {k: v for k, v in t.items() if k != "shipped_from"}
                    have.update({**fields, "built": True, "nodes": [*have["nodes"], node.name]})
        for name, t in seen.items():
            if (source := self.source_of(name)) is not None:
                builds, ships = self.counts(name)
                t.update({"built_on": source, "builds": builds, "ships": ships})
            t.pop("shipped_from", None)
        return sorted(seen.values(), key=lambda t: str(t["name"]))

    async def delete(self, name: str) -> None:
        """Removed from every node that has it (refused while one of them uses it)."""
        found = False
        for node in self.membership.healthy():
            answer = await node.call("DELETE", f"/v1/templates/{name}")
            if answer.status_code == 404:
                continue
            raise_for(answer, node.name)
            found = True
        kept = self._db.execute("DELETE FROM fleet_templates WHERE name = ?", (name,))
        if not found and not kept.rowcount:
            raise errors.NotFound(f"no template {name!r}")
