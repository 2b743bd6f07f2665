"""Placement around a node that does not answer, and replication through every door
(collected by `tests/integration/test_fleet.py` only, inside a loopback-only network
namespace): a node whose daemon is stopped (SIGSTOP: up in Ray's eyes, its port open, no
answer) does not hold up creates, which land on the other nodes, and is used again once it
answers; a sandbox made through E2B's SDK for a tenant of `replicate_tenants` gets its
replica as one made through cella's API does."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest

from tests.fleet.conftest import REPLICA_INTERVAL, REPLICATING, SHAPE, Fleet
from tests.fleet.e2b_checks import e2b
from tests.fleet.fleet_checks import wait_for
from tests.integration.test_e2b import E2B
from tests.sdk_env import sdk_python

# a create that waited on the stopped node (its client's read timeout is 600 s) fails here
CREATE_TIMEOUT_S = 100


@pytest.fixture(scope="module")
def python() -> Path:
    return sdk_python("e2b-2.63.0", E2B)  # made before the namespace (test_fleet.py)


def healthy(fleet: Fleet) -> list[str]:
    return sorted(n["name"] for n in fleet.admin.get("/v1/fleet").json()["nodes"] if n["healthy"])


def key_for(fleet: Fleet, tenant: str) -> str:
    return str(fleet.admin.post("/v1/keys", json={"tenant": tenant}).json()["key"])


@contextlib.contextmanager
def stopped(fleet: Fleet, node: str) -> Iterator[None]:
    """The node's daemon stopped (SIGSTOP) and, whatever happens, continued after."""
    pid = int((fleet.node_root / node / "node.pid").read_text())
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def test_creates_go_around_a_node_whose_daemon_does_not_answer(
    fleet: Fleet, tenant: httpx2.Client
) -> None:
    nodes = healthy(fleet)
    assert len(nodes) >= 2, nodes
    silent = nodes[0]
    hint = {"X-Cella-Node": silent}  # asked for, even: placed around while it is silent
    made: list[str] = []
    key = tenant.headers["authorization"].split()[1]
    with fleet.client(key) as client:
        client.timeout = httpx2.Timeout(CREATE_TIMEOUT_S)
        try:
            with stopped(fleet, silent):
                for _ in range(2):
                    answer = client.post("/v1/sandboxes", json=SHAPE, headers=hint)
                    assert answer.status_code == 201, answer.text
                    made.append(answer.json()["id"])
                    assert fleet.node_of(made[-1]) != silent
            # the control: it answers again, and is placed on again (once its pause is over)
            deadline = time.monotonic() + 120
            while True:
                answer = client.post("/v1/sandboxes", json=SHAPE, headers=hint)
                assert answer.status_code == 201, answer.text
                made.append(answer.json()["id"])
                if fleet.node_of(made[-1]) == silent:
                    break
                assert time.monotonic() < deadline, f"no create was placed on {silent} again"
                client.delete(f"/v1/sandboxes/{made.pop()}")
                time.sleep(2)
        finally:
            for sandbox_id in made:
                client.delete(f"/v1/sandboxes/{sandbox_id}")


def test_an_e2b_create_of_a_replicating_tenant_is_replicated(
    python: Path, fleet: Fleet, tenant: httpx2.Client
) -> None:
    """E2B's SDK through the gateway, for a tenant of `replicate_tenants`: its sandbox has
    a replica, refreshed on the period on another node; control: the same create by a
    tenant that does not replicate has none."""
    key = key_for(fleet, REPLICATING)
    script = "s = Sandbox.create()\nprint(json.dumps(s.sandbox_id))\n"
    kept = e2b(python, fleet, key, script)
    plain = e2b(python, fleet, tenant.headers["authorization"].split()[1], script)
    with fleet.client(key) as owner:
        try:
            copy = wait_for(
                lambda: (
                    (got := owner.get(f"/v1/sandboxes/{kept}/replica").json())["taken_at"] and got
                ),
                timeout=REPLICA_INTERVAL * 12,
                what="the E2B sandbox's replica",
            )
            assert copy["node"] not in (None, fleet.node_of(kept)) and copy["error"] is None
            assert owner.get(f"/v1/sandboxes/{kept}").json()["replicate"] is True
            refused = tenant.get(f"/v1/sandboxes/{plain}/replica")  # the control
            assert refused.status_code == 404 and "not replicated" in refused.text
        finally:
            owner.delete(f"/v1/sandboxes/{kept}")
            tenant.delete(f"/v1/sandboxes/{plain}")
