"""A large fleet's placement asks a sample of its nodes (the planner's own code over
stand-in nodes answering as node daemons do): the nodes it must see are always asked, and
a template built on one node outside the sample is still found (every node asked then)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx2

from cella.fleet.node_client import Node
from cella.fleet.planner import SAMPLE, Planner, Shape, sample


def node(name: str, templates: list[str], asked: list[str]) -> Node:
    def answer(request: httpx2.Request) -> httpx2.Response:
        asked.append(name)
        path = request.url.path
        body: Any = {"status": "ok", "pool": {}}
        if path == "/v1/capacity":
            body = {"memory_mib": 4096, "memory_mib_committed": 0, "vcpus": 8,
                    "vcpus_committed": 0, "live_sandboxes": 0}  # fmt: skip
        elif path == "/v1/templates":
            body = {"templates": [{"name": t, "built": True} for t in templates]}
        return httpx2.Response(200, content=json.dumps(body).encode())

    made = Node(name, name, f"http://{name}.test", "key")
    made.client = httpx2.AsyncClient(base_url=made.url, transport=httpx2.MockTransport(answer))
    return made


class Members:
    def __init__(self, nodes: list[Node]) -> None:
        self.nodes = {n.name: n for n in nodes}

    def healthy(self) -> list[Node]:
        return list(self.nodes.values())


class Named:
    def __init__(self, name: str) -> None:
        self.name = name


def test_a_sample_keeps_the_wanted_nodes_and_its_size() -> None:
    nodes: list[Any] = [Named(f"n{i:03d}") for i in range(1000)]
    assert sample(nodes[:SAMPLE], SAMPLE, set()) == nodes[:SAMPLE]
    picked = sample(nodes, SAMPLE, {"n750", "n007"})
    assert len(picked) == SAMPLE and len({n.name for n in picked}) == SAMPLE
    assert {"n750", "n007"} <= {n.name for n in picked}


def test_a_template_on_one_node_outside_the_sample_is_found() -> None:
    asked: list[str] = []
    nodes = [node(f"n{i:03d}", ["default"], asked) for i in range(69)]
    nodes.append(node("n069", ["default", "rare"], asked))
    planner = Planner(Members(nodes))  # type: ignore[arg-type]
    plan = asyncio.run(planner.plan(Shape(1, 512, "default"), 1, set()))
    assert len(asked) <= 3 * SAMPLE and len(plan) == 1  # a common template: the sample
    asked.clear()
    plan = asyncio.run(planner.plan(Shape(1, 512, "rare"), 1, set()))
    assert plan == {"n069": 1}
    asked.clear()
    hinted = asyncio.run(planner.plan(Shape(1, 512, "default"), 1, set(), prefer="n060"))
    assert hinted == {"n060": 1} and len(asked) <= 3 * SAMPLE


def test_a_template_no_node_has_goes_by_room_for_the_node_to_refuse() -> None:
    nodes = [node(f"n{i:03d}", ["default"], []) for i in range(3)]
    planner = Planner(Members(nodes))  # type: ignore[arg-type]
    assert len(asyncio.run(planner.plan(Shape(1, 512, "nowhere"), 1, set()))) == 1
