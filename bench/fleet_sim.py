"""The fleet's gateway past this machine, in simulation: its own placement and routing code
over stand-in nodes, no VMs and no Ray.

    .venv/bin/python -m bench.fleet_sim [--nodes 1000] [--sandboxes 100000] [--json]

Stand-in nodes are in-process objects answering the calls the gateway makes of a node
daemon (capacity, health, templates, sandbox lists, create, exec), reached through an
`httpx2.MockTransport`: what is timed is the gateway's code (`Membership`, `Planner`,
`placement_policy`, `Quotas`, `Launcher`, `Locator`, `Placements`, `relay.forward`) and
the HTTP client's work per call, never a network. Printed:

- placement: one create through `Launcher.launch` (quota admission from the placement records,
  `Planner.plan` asking every node for three reports, the policy, the node's create, the
  placement recorded) at 10, 100 and `--nodes` nodes; and the policy alone
  (`placement_policy.spread`) over that many candidates;
- routing: a call on a sandbox through the gateway (`Locator.node_of` in a placement table
  of `--sandboxes` rows, then `relay.forward` to its node) against the same call straight
  to the stand-in, and against an ASGI app that answers itself (the ASGI hop alone);
- the state store: `--sandboxes` placements written to SQLite, its size on disk, and its
  queries (one sandbox, a tenant's, a node's, the poll's `holding`, a node lost, a node's
  resync);
- membership: telling every node the fleet's addresses when one joins (each node is sent
  every address: the bytes grow with the square of the fleet).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx2
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from bench._stats import report, summary_ms
from cella.fleet.growth import Growth
from cella.fleet.launch import Launcher
from cella.fleet.locator import Locator
from cella.fleet.membership import Membership
from cella.fleet.node_client import Node
from cella.fleet.placement_policy import Candidate, spread
from cella.fleet.placement_table import Placements
from cella.fleet.planner import Planner, Shape
from cella.fleet.quotas import Quotas
from cella.fleet.relay import forward
from cella.fleet.snapshots import FleetSnapshots
from cella.fleet.templates import FleetTemplates
from cella.service.keys import Principal

SHAPE = Shape(vcpus=1, memory_mib=512, template="default")
TENANTS = 1000  # sandboxes are spread over this many tenants
Json = dict[str, Any]


class Body(httpx2.AsyncByteStream):
    """A stand-in's answer as a stream, as a real connection's is (the relay streams it)."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    async def __aiter__(self) -> Any:
        yield self.data


class StandIn:
    """A node daemon as the gateway sees it: its reports, its sandboxes, a create and an
    exec; answers in-process (`handle`, an httpx2 MockTransport handler)."""

    def __init__(self, name: str, memory_mib: int = 256 * 1024, vcpus: int = 128) -> None:
        self.name = name
        self.memory_mib = memory_mib
        self.vcpus = vcpus
        self.sandboxes: dict[str, Json] = {}
        self.calls = 0
        self.bytes_in = 0

    def body(self, sandbox_id: str, tenant: str, shape: Shape) -> Json:
        return {
            "id": sandbox_id,
            "tenant": tenant,
            "state": "running",
            "template": shape.template,
            "vcpus": shape.vcpus,
            "memory_mib": shape.memory_mib,
            "name": None,
            "labels": {},
            "created_at": datetime.now(UTC).isoformat(),
        }

    def _json(self, value: Any, status: int = 200) -> httpx2.Response:
        data = json.dumps(value).encode()
        headers = {"content-type": "application/json", "content-length": str(len(data))}
        return httpx2.Response(status, headers=headers, stream=Body(data))  # streamable

    def handle(self, request: httpx2.Request) -> httpx2.Response:
        self.calls += 1
        self.bytes_in += len(request.content)
        path, method = request.url.path, request.method
        tenant = request.headers.get("x-cella-tenant")
        if path == "/v1/capacity":
            live = len(self.sandboxes)
            return self._json({
                "memory_mib": self.memory_mib, "memory_mib_committed": live * SHAPE.memory_mib,
                "vcpus": self.vcpus, "vcpus_committed": live * SHAPE.vcpus,
                "live_sandboxes": live,
            })  # fmt: skip
        if path == "/v1/health":
            return self._json({"status": "ok", "pool": {}})
        if path == "/v1/templates":
            return self._json({"templates": [{"name": "default", "built": True}]})
        if path == "/v1/sandboxes" and method == "GET":
            mine = [b for b in self.sandboxes.values() if tenant is None or b["tenant"] == tenant]
            return self._json({"sandboxes": mine})
        if path == "/v1/sandboxes" and method == "POST":
            made = self.body(f"sbx-{random.getrandbits(64):016x}", tenant or "", SHAPE)
            self.sandboxes[made["id"]] = made
            return self._json(made, 201)
        if path == "/v1/egress/boundary/fleet":
            return self._json({"addresses": json.loads(request.content)["addresses"]})
        parts = path.split("/")
        if len(parts) >= 4 and parts[2] == "sandboxes" and parts[3] in self.sandboxes:
            if parts[-1] == "exec":
                return self._json({"exit_code": 0, "stdout": "", "stderr": ""})
            return self._json(self.sandboxes[parts[3]])
        return self._json({"error": {"code": "not_found", "message": path}}, 404)


def fleet_of(count: int, placements: Placements) -> tuple[Membership, dict[str, StandIn]]:
    """A membership of `count` stand-in nodes, joined as the gateway joins nodes (without
    Ray: the nodes are put where its poll puts them)."""

    async def joined(node: Node) -> None:
        return None

    membership = Membership("sim:6379", False, "/nonexistent", placements, joined)
    standins = {}
    for i in range(count):
        name = f"node-{i:05d}"
        standin = StandIn(name)
        node = Node(name, f"{i:056x}", f"http://{name}.sim:8080", f"key-{i}")
        node.client = httpx2.AsyncClient(
            base_url=node.url, transport=httpx2.MockTransport(standin.handle)
        )
        membership.nodes[name] = node
        standins[name] = standin
    return membership, standins


def launcher_of(membership: Membership, placements: Placements, root: Path) -> Launcher:
    """The gateway's create pipeline over the membership; what a plain create from a
    template does not touch (delegations, rewrites, volumes) is left out."""
    templates = FleetTemplates(root / f"templates-{len(membership.nodes)}.db", membership)
    planner = Planner(membership, shippable=templates.shippable)
    return Launcher(
        membership,
        Locator(membership, placements),
        Quotas(placements, membership, max_per_tenant=1 << 30),
        planner,
        FleetSnapshots(membership),
        None,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        Growth(membership, planner, enabled=False, wait_s=0, grace_s=0),
        templates,
    )


async def timed(call: Callable[[], Awaitable[Any]], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        await call()
        out.append(time.perf_counter() - t)
    return out


def sync_timed(call: Callable[[], Any], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        call()
        out.append(time.perf_counter() - t)
    return out


async def placement(sizes: list[int], root: Path) -> dict[str, Json]:
    rows: dict[str, Json] = {}
    for size in sizes:
        rows |= await placement_at(size, root)
    return rows


async def placement_at(size: int, root: Path) -> dict[str, Json]:
    rows: dict[str, Json] = {}
    placements = Placements(root / f"placement-{size}.db")
    membership, standins = fleet_of(size, placements)
    launcher = launcher_of(membership, placements, root)
    n = max(5, min(200, 20_000 // size))
    made = [0]

    async def create() -> None:
        made[0] += 1
        who = Principal(f"tenant-{made[0] % TENANTS}", admin=False)

        async def make(node: Node, count: int, _: str | None) -> list[Json]:
            return [await node.json("POST", "/v1/sandboxes", who, json={})]

        await launcher.launch(who, 1, SHAPE, make)

    calls = sum(s.calls for s in standins.values())
    times = await timed(create, n)
    per = (sum(s.calls for s in standins.values()) - calls) / n
    row = summary_ms(times)
    row["node calls"] = round(per)
    row["creates/s"] = round(1 / (sum(times) / n), 1)
    rows[f"create, {size} nodes"] = row
    plans = await timed(lambda: launcher.planner.plan(SHAPE, 1, set()), n)
    rows[f"  of which Planner.plan, {size} nodes"] = {
        **summary_ms(plans),
        "creates/s": round(1 / (sum(plans) / n), 1),
    }
    who = Principal("tenant-7", admin=False)

    async def admit() -> None:
        async with launcher.quotas.admitted(who, 1):
            pass

    rows[f"  of which quota admission, {size} nodes"] = summary_ms(await timed(admit, n))
    candidates = [Candidate(f"node-{i:05d}", random.randrange(1 << 18), 64) for i in range(size)]
    policy = sync_timed(lambda: spread(candidates, 1, 512, 1), 200)
    rows[f"  of which the policy alone, {size} nodes"] = {
        **summary_ms(policy),
        "creates/s": round(1 / (sum(policy) / 200)),
    }
    for node in membership.nodes.values():
        await node.close()
    return rows


def fill(placements: Placements, standins: dict[str, StandIn], count: int) -> list[str]:
    names = sorted(standins)
    ids = []
    for i in range(count):
        standin = standins[names[i % len(names)]]
        body = standin.body(f"sbx-{i:016x}", f"tenant-{i % TENANTS}", SHAPE)
        standin.sandboxes[body["id"]] = body
        placements.put(standin.name, body)
        ids.append(body["id"])
    return ids


async def store_and_routing(
    nodes: int, sandboxes: int, root: Path
) -> tuple[dict[str, Json], dict[str, Json], dict[str, Json]]:
    path = root / "placements.db"
    placements = Placements(path)
    membership, standins = fleet_of(nodes, placements)
    written: dict[str, Json] = {}
    t = time.perf_counter()
    ids = fill(placements, standins, sandboxes)
    took = time.perf_counter() - t
    written[f"{sandboxes} placements, one put each (a create)"] = {
        "total s": round(took, 2), "rows/s": round(sandboxes / took),
    }  # fmt: skip
    node_names = sorted(standins)
    lists = [list(standins[n].sandboxes.values()) for n in node_names]
    t = time.perf_counter()
    for name, bodies in zip(node_names, lists, strict=True):
        placements.put_many(name, bodies)  # what a fleet-wide list writes
    took = time.perf_counter() - t
    written[f"{sandboxes} placements, put_many per node (a list)"] = {
        "total s": round(took, 2), "rows/s": round(sandboxes / took),
    }  # fmt: skip
    size = sum(p.stat().st_size for p in root.glob("placements.db*"))
    written["size on disk (db + WAL), MiB"] = {"total s": "", "MiB": round(size / (1 << 20), 1)}
    rows: dict[str, Json] = {}
    pick = random.Random(1)
    queries: dict[str, Callable[[], Any]] = {
        "get one sandbox": lambda: placements.get(pick.choice(ids)),
        "a tenant's sandboxes": lambda: placements.of_tenant(f"tenant-{pick.randrange(TENANTS)}"),
        "a node's sandboxes": lambda: placements.on_node(pick.choice(node_names)),
        "lost (all tenants)": lambda: placements.lost(),
        "holding (every poll)": lambda: placements.holding(),
    }
    for name, query in queries.items():
        rows[f"query: {name}"] = summary_ms(sync_timed(query, 20 if "holding" in name else 200))
    node = node_names[0]
    bodies = list(standins[node].sandboxes.values())
    rows["a node lost (its rows marked)"] = summary_ms(
        sync_timed(lambda: placements.lose(node, "gone"), 5)
    )
    rows[f"a node's resync ({len(bodies)} rows)"] = summary_ms(
        sync_timed(lambda: placements.resync(node, bodies), 5)
    )

    # routing one call on a sandbox: through the locator and the relay, or straight there
    locator = Locator(membership, placements)
    who_of = {sid: Principal(f"tenant-{i % TENANTS}", admin=False) for i, sid in enumerate(ids)}

    async def via_gateway(request: Request) -> Response:
        sid = request.path_params["sid"]
        node = await locator.node_of(who_of[sid], sid)
        return await forward(request, node, who_of[sid])

    async def answer_here(request: Request) -> Response:
        return JSONResponse({"exit_code": 0, "stdout": "", "stderr": ""})

    app = Starlette(routes=[
        Route("/v1/sandboxes/{sid}/exec", via_gateway, methods=["POST"]),
        Route("/here/{sid}/exec", answer_here, methods=["POST"]),
    ])  # fmt: skip
    gateway = httpx2.AsyncClient(base_url="http://gateway.sim", transport=httpx2.ASGITransport(app))
    body = {"command": "true"}
    n = 2000

    async def direct() -> None:
        sid = pick.choice(ids)
        node = membership.nodes[placements.get(sid).node]  # type: ignore[union-attr]
        answer = await node.client.post(f"/v1/sandboxes/{sid}/exec", json=body)
        answer.raise_for_status()

    async def asgi_only() -> None:
        (await gateway.post(f"/here/{pick.choice(ids)}/exec", json=body)).raise_for_status()

    async def through() -> None:
        answer = await gateway.post(f"/v1/sandboxes/{pick.choice(ids)}/exec", json=body)
        answer.raise_for_status()

    for _ in range(200):  # warm up every path
        await direct()
        await asgi_only()
        await through()
    d, a, g = [], [], []
    for _ in range(n):  # interleaved: drift hits all three alike
        d += await timed(direct, 1)
        a += await timed(asgi_only, 1)
        g += await timed(through, 1)
    routed: dict[str, Json] = {}
    routed["exec: straight to the node (client + node)"] = summary_ms(d)
    routed["exec: an ASGI app answering itself"] = summary_ms(a)
    routed["exec: through the gateway (locator + relay)"] = summary_ms(g)
    p50 = {k: summary_ms(v)["p50"] for k, v in (("d", d), ("a", a), ("g", g))}
    routed["gateway overhead per call (p50 through - p50 straight)"] = {
        "p50": round(p50["g"] - p50["d"], 3)
    }
    routed["  of it locate + relay (p50 through - p50 ASGI alone)"] = {
        "p50": round(p50["g"] - p50["a"], 3)
    }
    await gateway.aclose()
    for member in membership.nodes.values():
        await member.close()
    return written, rows, routed


async def membership_costs(sizes: list[int], root: Path) -> dict[str, Json]:
    rows: dict[str, Json] = {}
    for size in sizes:
        placements = Placements(root / f"members-{size}.db")
        membership, standins = fleet_of(size, placements)
        wanted = sorted(f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}" for i in range(size + 1))
        t = time.perf_counter()
        for node in membership.healthy():  # a node joined: every node is told the new list
            await membership._tell_fleet(node, wanted)
        took = time.perf_counter() - t
        sent = sum(s.bytes_in for s in standins.values())
        t = time.perf_counter()
        for node in membership.healthy():  # every poll, nothing changed: lists compared
            await membership._tell_fleet(node, list(wanted))
        idle = time.perf_counter() - t
        rows[f"{size} nodes"] = {
            "one join: s": round(took, 3), "one join: MiB sent": round(sent / (1 << 20), 2),
            "grow to it: MiB": round(sent / (1 << 20) * size / 3, 1),  # sum of k^2 ~ n^3/3
            "a poll, no change: ms": round(idle * 1000, 2),
        }  # fmt: skip
        for node in membership.nodes.values():
            await node.close()
    return rows


async def main(nodes: int, sandboxes: int, as_json: bool) -> None:
    os.environ.setdefault("COLUMNS", "160")  # the tables' width when not on a terminal
    random.seed(7)
    with tempfile.TemporaryDirectory(prefix="cella-fleet-sim-") as tmp:
        root = Path(tmp)
        sizes = sorted({10, 100, nodes})
        report("placement (one create at a time)", await placement(sizes, root), as_json)
        written, queries, routed = await store_and_routing(nodes, sandboxes, root)
        where = f"{nodes} nodes, {sandboxes} sandboxes"
        report(f"the state store, written (SQLite, {where})", written, as_json)
        report(f"the state store, queried ({where})", queries, as_json)
        report(f"a call on a sandbox, routed ({where})", routed, as_json)
        joins = await membership_costs(sizes, root)
        report("membership: the fleet's addresses told to every node", joins, as_json)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--sandboxes", type=int, default=100_000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    asyncio.run(main(args.nodes, args.sandboxes, args.json))
