"""Templates on a fleet: one built through the gateway is built on every node, so that a
sandbox of it may be placed on any.

An image build (`POST /v1/templates`) goes to every healthy node at once, their progress
streamed back as one JSON Lines stream (each line naming its node), `done` once every node
has it (a build that fails on one node is removed from the others: all or none). Its
request is kept here, and a node that joins later builds the ones it lacks in the
background (the planner places sandboxes of a template only on nodes that have it built,
where any has). A Dockerfile build's context is spooled here and sent to every node alike
(not kept: a node that joins later does not build it). The list is every node's, a
template built where any node built it; a removal is every node's."""

from __future__ import annotations

import asyncio
import contextlib
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
SCHEMA = "CREATE TABLE IF NOT EXISTS {table} (name TEXT PRIMARY KEY, body TEXT NOT NULL)"
Json = dict[str, Any]
# one node's build: the request made there, streamed
Send = Callable[[Node], Awaitable[httpx2.Response]]


class FleetTemplates:
    def __init__(self, where: Path | str | Database, membership: Membership) -> None:
        self.membership = membership
        self._db = database(where)
        # a database shared with the store names it apart from the store's template builds
        self._table = "template_builds" if self._db.dialect == "sqlite" else "fleet_templates"
        self._db.ensure(self._table, SCHEMA.format(table=self._table))
        self._tasks: set[asyncio.Task[Any]] = set()  # builds outlive their callers

    # -- builds -------------------------------------------------------------------------------

    def build_image(self, body: TemplateBuild) -> AsyncIterator[bytes]:
        """An image build on every healthy node, kept for nodes that join later."""
        sent = body.model_dump(mode="json", exclude_unset=True)
        self._db.execute(
            f"INSERT INTO {self._table} VALUES (?, ?) "
            "ON CONFLICT (name) DO UPDATE SET body = excluded.body",
            (body.name, json.dumps(sent)),
        )

        def send(node: Node) -> Awaitable[httpx2.Response]:
            request = node.client.build_request(
                "POST", "/v1/templates", json=sent, headers=node.headers(None)
            )
            return node.client.send(request, stream=True)

        def kept(built: bool) -> None:
            if not built:  # a build that failed is not one for joining nodes to repeat
                self._db.execute(f"DELETE FROM {self._table} WHERE name = ?", (body.name,))

        return self._everywhere(send, kept)

    def build_dockerfile(self, name: str, query: str, spool: IO[bytes]) -> AsyncIterator[bytes]:
        """A Dockerfile build on every healthy node, each sent the spooled context."""

        async def context() -> AsyncIterator[bytes]:
            offset = 0  # each node's own (pread: the file's offset is shared)
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

        return self._everywhere(send, lambda _: spool.close())

    def _everywhere(self, send: Send, on_end: Callable[[bool], None]) -> AsyncIterator[bytes]:
        """The build `send` starts on each healthy node, run as the gateway's own task (a
        client that goes away does not stop it); its progress, then one outcome: `done`
        with the first node's template once every node has it, else the first error."""
        nodes = self.membership.healthy()
        if not nodes:
            on_end(False)
            raise errors.NodeUnavailable("no node of the fleet is up")
        queue: asyncio.Queue[Json | None] = asyncio.Queue()

        async def on(node: Node) -> Json:
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
            failed: list[tuple[Node, Json]] = [(nodes[0], {})]
            try:
                ends = await asyncio.gather(*(on(n) for n in nodes))
                failed = [(n, e) for n, e in zip(nodes, ends, strict=True) if e["type"] != "done"]
                if failed:
                    node, end = failed[0]
                    queue.put_nowait({**end, "message": f"node {node.name}: {end.get('message')}"})
                    for built, done in zip(nodes, ends, strict=True):  # all or none
                        if done["type"] == "done":
                            with contextlib.suppress(errors.CellaError, httpx2.HTTPError):
                                name = done["template"]["name"]
                                await built.call("DELETE", f"/v1/templates/{name}")
                else:
                    queue.put_nowait(ends[0])
            finally:
                on_end(not failed)
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

    async def push_to(self, node: Node) -> None:
        """A joining node builds, in the background, the image templates built through the
        gateway that it lacks."""
        kept = self._db.execute(f"SELECT name, body FROM {self._table}").fetchall()
        if not kept:
            return
        listed = await node.json("GET", "/v1/templates")
        built = {t["name"] for t in listed["templates"] if t["built"]}
        missing = [(name, body) for name, body in kept if name not in built]

        async def build() -> None:
            for name, body in missing:
                try:
                    sent, headers = json.loads(body), node.headers(None)
                    async with node.client.stream(
                        "POST", "/v1/templates", json=sent, headers=headers
                    ) as answer:
                        async for _ in answer.aiter_lines():
                            pass
                    log.info("template %s built on joining node %s", name, node.name)
                except Exception as exc:  # it is placed on the others meanwhile
                    log.warning("template %s on node %s: %s", name, node.name, exc)

        if missing:
            self._start(build())

    # -- the list, and removal ---------------------------------------------------------------

    async def listed(self, tenant: str | None) -> list[Json]:
        """Every node's templates (a tenant's own and the shared ones), each once: built
        where any node built it, with the nodes that have it."""
        seen: dict[str, Json] = {}
        for node, answer in await self.membership.each("GET", "/v1/templates", None):
            for t in answer["templates"]:
                if tenant is not None and t.get("tenant") not in (None, tenant):
                    continue
                have = seen.setdefault(t["name"], {**t, "built": False, "nodes": []})
                if t["built"]:
                    have.update({**t, "built": True, "nodes": [*have["nodes"], node.name]})
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
        kept = self._db.execute(f"DELETE FROM {self._table} WHERE name = ?", (name,))
        if not found and not kept.rowcount:
            raise errors.NotFound(f"no template {name!r}")
