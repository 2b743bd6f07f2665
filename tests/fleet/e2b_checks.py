"""E2B's SDK (`e2b==2.63.0`, pinned, in its own environment, unchanged) through the fleet
gateway (collected by `tests/integration/test_fleet.py` with the other fleet checks, on the
same cluster): pointed at the gateway alone, it drives sandboxes on two nodes, their
commands and files (envd's traffic relayed to each node), a pause and a resume, merged
lists and timeouts; what is not there is E2B's not-found."""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest

from tests.fleet.conftest import Fleet
from tests.fleet.fleet_checks import node_has_secret
from tests.integration.test_e2b import E2B  # the one pin of the SDK
from tests.sdk_env import run_script, sdk_python


@pytest.fixture(scope="module")
def python() -> Path:
    return sdk_python("e2b-2.63.0", E2B)  # made before the namespace (test_fleet.py)


@pytest.fixture(autouse=True)
def cleanup(tenant: httpx2.Client) -> Iterator[None]:
    """Whatever a check leaves behind (sandboxes, its snapshots) is gone before the next."""
    before = {s["id"] for s in tenant.get("/v1/snapshots").json()["snapshots"]}
    yield
    for sb in tenant.get("/v1/sandboxes").json()["sandboxes"]:
        tenant.delete(f"/v1/sandboxes/{sb['id']}")
    for snap in tenant.get("/v1/snapshots").json()["snapshots"]:
        if snap["id"] not in before:
            tenant.delete(f"/v1/snapshots/{snap['id']}")


def key_of(tenant: httpx2.Client) -> str:
    return tenant.headers["authorization"].split()[1]


def e2b(python: Path, fleet: Fleet, key: str, script: str) -> Any:
    env = {
        "E2B_API_URL": fleet.gateway.url,
        "E2B_SANDBOX_URL": fleet.gateway.url,
        "E2B_API_KEY": key,
    }
    preamble = "import json, time\nfrom e2b import *\n"
    return run_script(python, preamble + textwrap.dedent(script), env)


def two_nodes(fleet: Fleet) -> list[str]:
    up = [n["name"] for n in fleet.admin.get("/v1/fleet").json()["nodes"] if n["healthy"]]
    assert len(up) >= 2, up
    return sorted(up)[:2]


def test_the_e2b_sdk_through_the_gateway(python: Path, fleet: Fleet, tenant: httpx2.Client) -> None:
    first, second = two_nodes(fleet)
    key = key_of(tenant)
    made = e2b(
        python,
        fleet,
        key,
        f"""
        a = Sandbox.create(metadata={{"check": "e2b-fleet", "i": "a"}}, envs={{"FOO": "bar 1"}},
                           timeout=120, api_headers={{"x-cella-node": "{first}"}})
        b = Sandbox.create(metadata={{"check": "e2b-fleet", "i": "b"}},
                           api_headers={{"x-cella-node": "{second}"}})
        print(json.dumps([a.sandbox_id, b.sandbox_id]))
        """,
    )
    assert [fleet.node_of(i) for i in made] == [first, second]  # one on each node
    got = e2b(
        python,
        fleet,
        key,
        f"""
        out = {{}}
        a, b = Sandbox.connect("{made[0]}"), Sandbox.connect("{made[1]}")
        out["ids"] = [a.sandbox_id, b.sandbox_id]
        out["env"] = a.commands.run('printf %s "$FOO"').stdout
        out["whoami"] = b.commands.run("whoami; pwd").stdout.split()
        a.files.write("/home/user/note.txt", "kept across a pause")
        out["read"] = a.files.read("/home/user/note.txt")
        out["listed_files"] = sorted(e.name for e in a.files.list("/home/user"))
        pager = Sandbox.list(query=SandboxQuery(metadata={{"check": "e2b-fleet"}}), limit=1)
        pages = []
        while pager.has_next:
            pages.append([s.metadata["i"] for s in pager.next_items()])
        out["pages"] = pages
        a.set_timeout(600)
        info = a.get_info()
        out["left"] = (info.end_at - info.started_at).total_seconds()
        out["paused"] = a.pause()
        out["listed_paused"] = [s.sandbox_id for s in Sandbox.list(
            query=SandboxQuery(metadata={{"check": "e2b-fleet"}}, state=[SandboxState.PAUSED])
        ).next_items()]
        back = Sandbox.connect(a.sandbox_id, timeout=300)
        out["state"] = back.get_info().state.value
        out["after_resume"] = back.files.read("/home/user/note.txt")
        out["killed"] = [Sandbox.kill(i) for i in out["ids"]]
        out["left_over"] = [s.sandbox_id for s in Sandbox.list(
            query=SandboxQuery(metadata={{"check": "e2b-fleet"}})).next_items()]
        missing = {{}}
        for name, call in (("connect", lambda: Sandbox.connect("sb-0000000000000000")),
                           ("info", lambda: Sandbox.get_info("sb-0000000000000000")),
                           ("gone", lambda: Sandbox.get_info(a.sandbox_id))):
            try:
                call()
                missing[name] = "found"
            except NotFoundException as e:
                missing[name] = type(e).__name__
        missing["kill"] = Sandbox.kill("sb-0000000000000000")
        out["missing"] = missing
        print(json.dumps(out))
        """,
    )
    a = made[0]
    assert got["ids"] == made
    assert got["env"] == "bar 1" and got["whoami"] == ["user", "/home/user"]
    assert got["read"] == "kept across a pause" and "note.txt" in got["listed_files"]
    assert got["pages"] == [["a"], ["b"]]  # merged from both nodes, one per page
    assert 590 <= got["left"] <= 900, got["left"]  # the timeout set through the gateway
    assert got["paused"] is True and got["listed_paused"] == [a]
    assert got["state"] == "running" and got["after_resume"] == "kept across a pause"
    assert got["killed"] == [True, True] and got["left_over"] == []
    # the control: what no node has is E2B's not-found, the same calls as above
    assert got["missing"] == {
        "connect": "SandboxNotFoundException",
        "info": "SandboxNotFoundException",
        "gone": "SandboxNotFoundException",
        "kill": False,
    }, got["missing"]


def test_snapshots_and_forks_of_the_e2b_sdk_across_nodes(
    python: Path, fleet: Fleet, tenant: httpx2.Client
) -> None:
    """A snapshot taken on one node makes a sandbox on another (shipped there); a fork is
    placed where there is room (each node holds one such sandbox); metrics are read on
    each one's node."""
    up = [n["name"] for n in fleet.admin.get("/v1/fleet").json()["nodes"] if n["healthy"]]
    first, second, third = sorted(up)[:3]
    got = e2b(
        python,
        fleet,
        key_of(tenant),
        f"""
        out = {{}}
        a = Sandbox.create(api_headers={{"x-cella-node": "{first}"}})
        a.files.write("/home/user/mark.txt", "written before the snapshot")
        snap = a.create_snapshot()
        out["snapshot"] = snap.snapshot_id
        out["listed"] = [s.snapshot_id for s in Sandbox.list_snapshots().next_items()]
        c = Sandbox.create(snap.snapshot_id, api_headers={{"x-cella-node": "{second}"}})
        out["from_snapshot"] = c.files.read("/home/user/mark.txt")
        [fork] = a.fork(timeout=200)
        out["fork_read"] = fork.files.read("/home/user/mark.txt")
        out["fork_left"] = (fork.get_info().end_at - fork.get_info().started_at).total_seconds()
        out["ids"] = [a.sandbox_id, c.sandbox_id, fork.sandbox_id]
        out["metrics"] = type(Sandbox.get_metrics(c.sandbox_id)).__name__
        try:
            Sandbox.get_metrics("sb-0000000000000000")
        except NotFoundException as e:
            out["metrics_missing"] = type(e).__name__
        print(json.dumps(out))
        """,
    )
    assert [fleet.node_of(i) for i in got["ids"]] == [first, second, third]
    assert got["listed"].count(got["snapshot"]) == 1  # held by two nodes, listed once
    assert got["from_snapshot"] == got["fork_read"] == "written before the snapshot"
    assert 190 <= got["fork_left"] <= 260, got["fork_left"]
    assert got["metrics"] == "list" and got["metrics_missing"] == "SandboxNotFoundException"


def test_envd_by_host_name_through_the_gateway(fleet: Fleet, tenant: httpx2.Client) -> None:
    """`get_host(49983)`'s name, `49983-{id}.{domain}`, names the gateway and reaches the
    sandbox's envd on its node; without the sandbox's envd token it is refused there."""
    key = {"x-api-key": key_of(tenant)}
    made = tenant.post("/sandboxes", headers=key, json={"timeout": 120})
    assert made.status_code == 201, made.text
    sandbox = made.json()
    try:
        port = fleet.gateway.url.rpartition(":")[2]
        domain = sandbox["domain"]
        assert domain == f"localhost:{port}"  # the gateway's, not its node's
        host = {"host": f"49983-{sandbox['sandboxID']}.{domain}"}
        token = {"x-access-token": sandbox["envdAccessToken"]}
        assert tenant.get("/health", headers=host | token).status_code == 204
        refused = tenant.get("/health", headers=host | {"x-access-token": "wrong"})
        assert refused.status_code == 401, refused.text
        unknown = {"host": "49983-sb-0000000000000000." + domain}
        assert tenant.get("/health", headers=unknown | token).status_code == 502
    finally:
        assert tenant.delete(f"/sandboxes/{sandbox['sandboxID']}", headers=key).status_code == 204


def test_e2b_secrets_through_the_gateway_reach_every_node(
    python: Path, fleet: Fleet, tenant: httpx2.Client
) -> None:
    """`Secret` through the gateway is the fleet's secret: on every node (where a header
    rule of a sandbox placed anywhere names it), its value never in an answer."""
    up = [n["name"] for n in fleet.admin.get("/v1/fleet").json()["nodes"] if n["healthy"]]
    got = e2b(
        python,
        fleet,
        key_of(tenant),
        """
        made = Secret.create("fleet_token", "v1-value", metadata={"team": "red"})
        newer = Secret.update(made.secret_id, "v2-value")
        listed = [s.name for s in Secret.list().next_items()]
        print(json.dumps({"id": made.secret_id, "version": newer.version,
                          "metadata": newer.metadata, "listed": listed,
                          "exists": [Secret.exists("fleet_token"), Secret.exists("nope")]}))
        """,
    )
    assert got["id"] == "sec_fleet_token" and got["version"] == 2
    assert got["metadata"] == {"team": "red"} and "fleet_token" in got["listed"]
    assert got["exists"] == [True, False]  # the control: one nobody made is not there
    assert all(node_has_secret(fleet, n, "acme", "fleet_token") for n in up)
    gone = e2b(python, fleet, key_of(tenant), 'print(json.dumps(Secret.destroy("fleet_token")))')
    assert gone is True
    assert not any(node_has_secret(fleet, n, "acme", "fleet_token") for n in up)
