"""A fleet that grows and shrinks with Ray's autoscaler: a cluster of its own whose
autoscaler (Ray's `fake_multinode` provider) starts sandbox nodes on this machine, each with
room for one sandbox, none at first. Demand beyond what the fleet has brings a node up and
the waiting create lands there; a node whose sandboxes are gone is removed, and one that
still has a sandbox stays; with the gateway's autoscaling off, the same create is refused at
once and no node comes.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2
import pytest

from tests.daemon import Daemon, kill_vms_of
from tests.raycluster import STORE, AutoscalingCluster, quiet_ray_env

SHAPE = {"memory_mib": 256}
IDLE_S = 4.0  # Ray's idle timeout: short, so a node the fleet does not hold goes quickly
NODE_TYPE = {
    "resources": {"CPU": 1, "cella_node": 1, "object_store_memory": STORE},
    "min_workers": 0,
    "max_workers": 2,
    "labels": {
        "cella/node-group": "auto",
        "cella/pool_size": "0",
        "cella/pool_spares": "0",
        "cella/max_host_memory_mib": "256",  # room for one sandbox of SHAPE
    },
}
GROWING = {
    "fleet_autoscale": "true",
    "fleet_scale_up_wait_s": "150",
    "fleet_scale_down_grace_s": "2",
}


@dataclass
class Grown:
    cluster: AutoscalingCluster
    gateway: Daemon
    node_root: Path
    tenant: httpx2.Client

    def admin(self) -> httpx2.Client:
        return client(self.gateway, self.gateway.admin_key)

    def nodes(self) -> dict[str, dict[str, Any]]:
        with self.admin() as admin:
            return {n["name"]: n for n in admin.get("/v1/fleet").json()["nodes"]}

    def growth(self) -> dict[str, Any] | None:
        with self.admin() as admin:
            found: dict[str, Any] | None = admin.get("/v1/fleet").json()["autoscale"]
        return found

    def held(self) -> set[str]:
        growth = self.growth()
        assert growth is not None
        return set(growth["held_nodes"])

    def up(self) -> set[str]:
        return {name for name, n in self.nodes().items() if n["healthy"]}

    def node_of(self, sandbox_id: str) -> str:
        held = [d.name for d in self.node_root.iterdir() if (d / "vms" / sandbox_id).exists()]
        assert len(held) == 1, f"{sandbox_id} is on {held}"
        return held[0]


def client(gateway: Daemon, key: str) -> httpx2.Client:
    return httpx2.Client(
        base_url=gateway.url,
        headers={"authorization": f"Bearer {key}"},
        timeout=httpx2.Timeout(240.0),  # a create may wait for a node to join
    )


def until(what: Callable[[], bool], timeout: float, why: str) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, why
        time.sleep(0.5)


def create(grown: Grown) -> dict[str, Any]:
    answer = grown.tenant.post("/v1/sandboxes", json=SHAPE)
    assert answer.status_code == 201, answer.text
    return dict(answer.json())


def echo(grown: Grown, sandbox_id: str, word: str) -> None:
    answer = grown.tenant.post(f"/v1/sandboxes/{sandbox_id}/exec", json={"command": f"echo {word}"})
    assert answer.status_code == 200, answer.text
    assert answer.json()["stdout"].strip() == word


@pytest.fixture(scope="module")
def grown() -> Iterator[Grown]:
    quiet_ray_env()
    root = Path(tempfile.mkdtemp(prefix="cella-grown-"))
    cluster = AutoscalingCluster(NODE_TYPE, IDLE_S).start()
    gateway = None
    try:
        gateway = Daemon(
            root / "gateway",
            args=["--ray", cluster.address, "--node-root", str(root / "nodes")],
            **GROWING,
        ).start(timeout=120)
        with client(gateway, gateway.admin_key) as admin:
            key = admin.post("/v1/keys", json={"tenant": "acme"}).json()["key"]
        with client(gateway, key) as tenant:
            yield Grown(cluster, gateway, root / "nodes", tenant)
    finally:
        if gateway is not None:
            gateway.stop()
        cluster.shutdown()
        for node in (root / "nodes").iterdir() if (root / "nodes").exists() else []:
            kill_vms_of(node)
        shutil.rmtree(root, ignore_errors=True)


def test_demand_beyond_the_fleet_brings_a_node_up_where_the_create_lands(grown: Grown) -> None:
    assert grown.up() == set()  # no node until there is demand
    first = create(grown)  # from none: the first node comes for it
    echo(grown, first["id"], "first")
    [one] = grown.up()
    assert grown.node_of(first["id"]) == one
    second = create(grown)  # the one node is full: a second comes for it
    echo(grown, second["id"], "second")
    assert len(grown.up()) == 2
    assert grown.node_of(second["id"]) == (grown.up() - {one}).pop()
    echo(grown, first["id"], "still")
    assert grown.held() == grown.up()  # both hold sandboxes: neither may be taken
    # nothing waits any more: the floor asked of the autoscaler is cleared
    until(lambda: (grown.growth() or {}).get("nodes_asked") == 0, 30, "the floor stayed")


def test_a_node_without_sandboxes_goes_and_one_with_a_sandbox_stays(grown: Grown) -> None:
    listed = grown.tenant.get("/v1/sandboxes").json()["sandboxes"]
    first, second = sorted(listed, key=lambda s: s["created_at"])
    kept, emptied = grown.node_of(first["id"]), grown.node_of(second["id"])
    assert grown.tenant.delete(f"/v1/sandboxes/{second['id']}").status_code == 204
    gone = f"{emptied} was released when idle and left the cluster"
    until(lambda: gone in str(grown.nodes()[emptied]["reason"]), 90, f"{emptied} stayed")
    # control: the node with a sandbox, in the fleet for longer than the grace period and
    # Ray's idle timeout together, was neither released nor removed: its sandbox answers
    assert grown.up() == {kept} and grown.held() == {kept}
    echo(grown, first["id"], "kept")


def test_without_autoscaling_a_create_with_no_room_is_refused_at_once(grown: Grown) -> None:
    gateway = grown.gateway
    gateway.stop()
    gateway.settings |= {"fleet_autoscale": "false"}
    gateway.start(timeout=120)
    try:
        [kept] = grown.up()
        assert grown.growth() is None  # the gateway does not autoscale now
        answer = grown.tenant.post("/v1/sandboxes", json=SHAPE)  # the one node is full
        assert answer.status_code == 409, answer.text
        error = answer.json()["error"]
        assert error["code"] == "capacity_exceeded", error
        assert "no room" in error["message"] and "autoscaler" not in error["message"], error
        time.sleep(2 * IDLE_S)  # a node asked for would have joined by now (it took less)
        assert grown.up() == {kept}, "a node came without being asked for"
    finally:
        gateway.stop()
        gateway.settings |= GROWING
        gateway.start(timeout=120)
    for sandbox in grown.tenant.get("/v1/sandboxes").json()["sandboxes"]:
        assert grown.tenant.delete(f"/v1/sandboxes/{sandbox['id']}").status_code == 204
