"""The gateway's side of shipping a template by digest (its own code over stand-in nodes
answering as node daemons do): the source is asked first, a copy refused there is followed
by the next holder, a node holding the last build is left alone, an older build is shipped
over."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx2
import pytest

from cella import errors
from cella.fleet.node_client import Node
from cella.fleet.templates import FleetTemplates

NEW, OLD = "a" * 64, "b" * 64


class Dest:
    """A node that lacks the template until it imports it; refuses copies from `bad`."""

    def __init__(self, bad: set[str]) -> None:
        self.bad = bad
        self.held: str | None = None
        self.asked: list[str] = []

    def answer(self, request: httpx2.Request) -> httpx2.Response:
        if request.method == "GET":
            if self.held is None:
                return reply(404, {"error": {"code": "not_found", "message": "no template"}})
            return reply(200, {"name": "t", "built": True, "sha256": self.held})
        source = json.loads(request.content)["source_node"]
        self.asked.append(source)
        if source in self.bad:
            return reply(409, {"error": {"code": "template_corrupt", "message": "refused"}})
        self.held = NEW
        return reply(201, {"name": "t", "built": True, "sha256": NEW})


def reply(status: int, body: Any) -> httpx2.Response:
    return httpx2.Response(status, content=json.dumps(body).encode())


def node(name: str, dest: Dest | None = None) -> Node:
    made = Node(name, name, f"http://{name}.test", "key")
    handler = dest.answer if dest else (lambda _: reply(500, {}))
    made.client = httpx2.AsyncClient(base_url=made.url, transport=httpx2.MockTransport(handler))
    return made


class Members:
    def __init__(self, nodes: list[Node]) -> None:
        self.nodes = {n.name: n for n in nodes}

    def healthy(self) -> list[Node]:
        return list(self.nodes.values())


def fleet(tmp_path: Path, bad: set[str]) -> tuple[FleetTemplates, Dest, Node]:
    dest = Dest(bad)
    target = node("d", dest)
    templates = FleetTemplates(tmp_path / "t.db", Members([node("n2"), node("n1"), target]))  # type: ignore[arg-type]
    templates._built("t", "n1", NEW)
    return templates, dest, target


def test_a_copy_refused_from_the_source_is_shipped_from_the_next_holder(tmp_path: Path) -> None:
    templates, dest, target = fleet(tmp_path, bad={"n1"})
    asyncio.run(templates.ensure_on("t", target))
    assert dest.asked == ["n1", "n2"] and dest.held == NEW
    assert templates.counts("t") == (1, 1)
    asyncio.run(templates.ensure_on("t", target))  # held with the last build's digest
    assert dest.asked == ["n1", "n2"]
    dest.held = OLD  # an older build: shipped over
    asyncio.run(templates.ensure_on("t", target))
    assert dest.asked[-1] == "n2" and dest.held == NEW


def test_every_holder_refused_fails_the_ship_clearly(tmp_path: Path) -> None:
    templates, dest, target = fleet(tmp_path, bad={"n1", "n2"})
    with pytest.raises(errors.TemplateCorrupt):
        asyncio.run(templates.ensure_on("t", target))
    assert dest.held is None and templates.counts("t") == (1, 0)


def test_a_template_not_built_through_the_gateway_is_not_shipped(tmp_path: Path) -> None:
    templates, dest, target = fleet(tmp_path, bad=set())
    asyncio.run(templates.ensure_on("default", target))
    assert dest.asked == []
    with pytest.raises(errors.NotFound):
        asyncio.run(templates.ship_ahead("default", None))


def test_a_joining_node_and_one_asked_for_are_shipped_ahead(tmp_path: Path) -> None:
    templates, dest, target = fleet(tmp_path, bad=set())

    async def join() -> None:
        await templates.push_to(target)
        await asyncio.gather(*templates._tasks)

    asyncio.run(join())
    assert dest.asked == ["n1"] and dest.held == NEW
    dest.held = None
    asyncio.run(templates.ship_ahead("t", ["d"]))
    assert dest.asked == ["n1", "n1"] and dest.held == NEW
    with pytest.raises(errors.NodeUnavailable, match="nowhere"):
        asyncio.run(templates.ship_ahead("t", ["nowhere"]))
