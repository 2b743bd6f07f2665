"""Replicated sandboxes outlive their node (collected by `tests/integration/test_fleet.py`
only, inside a loopback-only network namespace): a copy of the disk on a second node,
refreshed on stop and on a period (a paused sandbox's with its memory, and a running one's
too with `replicate_memory`: a live snapshot); the node killed, the sandbox comes back
`recovered` there with its files, stopped from a copy of its disk, paused from one with
memory (a resume goes on with its processes), and an unreplicated one beside it is
`lost`."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import datetime

import httpx2
import pytest

from tests.fleet.conftest import NODE_SETTINGS, REPLICA_INTERVAL, REPLICATING, SHAPE, Fleet
from tests.fleet.fleet_checks import create, delete_all, run, wait_for
from tests.fleet.move_checks import COUNTER


@pytest.fixture(scope="module")
def owner(fleet: Fleet) -> Iterator[httpx2.Client]:
    key = fleet.admin.post("/v1/keys", json={"tenant": "keeper"}).json()["key"]
    with fleet.client(key) as client:
        yield client
        delete_all(client)


@pytest.fixture(scope="module")
def replicating(fleet: Fleet) -> Iterator[httpx2.Client]:
    key = fleet.admin.post("/v1/keys", json={"tenant": REPLICATING}).json()["key"]
    with fleet.client(key) as client:
        yield client
        delete_all(client)


def replica(client: httpx2.Client, sandbox_id: str) -> dict[str, object]:
    answer = client.get(f"/v1/sandboxes/{sandbox_id}/replica")
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def taken(shown: dict[str, object]) -> float:
    return datetime.fromisoformat(str(shown["taken_at"])).timestamp() if shown["taken_at"] else 0


def counter(client: httpx2.Client, sandbox_id: str) -> int:
    return int(str(run(client, sandbox_id, "cat /run/counter")["stdout"]))


def started(client: httpx2.Client, sandbox_id: str) -> str:
    """The counter process's start time (field 22 of its stat): the same process."""
    done = run(client, sandbox_id, "cut -d' ' -f22 /proc/$(cat /run/counter.pid)/stat")
    return str(done["stdout"]).strip()


def test_a_tenants_sandboxes_are_copied_every_period(
    fleet: Fleet, replicating: httpx2.Client, owner: httpx2.Client
) -> None:
    """A tenant of `replicate_tenants`: its sandbox is replicated without asking, the copy
    refreshed while it runs, on another node than its own; control: another tenant's
    sandbox made the same way has no replica."""
    sb = create(replicating)
    assert sb["replicate"] is True
    first = wait_for(
        lambda: (got := replica(replicating, str(sb["id"])))["taken_at"] and got,
        timeout=REPLICA_INTERVAL * 12,
        what="the first replica",
    )
    second = wait_for(
        lambda: taken(got := replica(replicating, str(sb["id"]))) > taken(first) and got,
        timeout=REPLICA_INTERVAL * 12,
        what="the replica refreshed on the period",
    )
    home = fleet.node_of(str(sb["id"]))
    assert first["node"] != home and second["node"] != home, (home, first, second)
    assert int(str(second["size_bytes"])) > 0 and second["error"] is None
    # the copies are the gateway's: not among the tenant's snapshots
    assert replicating.get("/v1/snapshots").json()["snapshots"] == []
    plain = create(owner)
    assert plain["replicate"] is False
    refused = owner.get(f"/v1/sandboxes/{plain['id']}/replica")
    assert refused.status_code == 404 and "not replicated" in refused.text
    owner.delete(f"/v1/sandboxes/{plain['id']}")
    assert replicating.delete(f"/v1/sandboxes/{sb['id']}").status_code == 204


def test_a_killed_nodes_replicated_sandbox_comes_back_recovered(
    fleet: Fleet, owner: httpx2.Client
) -> None:
    """A replicated sandbox writes a file, stops (its replica refreshed), is resumed; its
    node is killed: it comes back `recovered` on the replica's node, stopped, with the
    file, and runs again when resumed. Beside it, one made with `replicate_memory` runs a
    counter in memory (its replica a live snapshot each period, the guest's pause in the
    record), then is paused (its replica refreshed with its memory): it comes back
    `recovered` paused, and resumed, the same process counts on from at least its value at
    the pause, its file on disk there. Control: an unreplicated sandbox on the same node
    is `lost`."""
    fleet.cluster.add("n6", **NODE_SETTINGS)
    wait_for(
        lambda: any(
            n["name"] == "n6" and n["healthy"] for n in fleet.admin.get("/v1/fleet").json()["nodes"]
        ),
        what="n6 to join",
    )
    on_n6 = {"X-Cella-Node": "n6"}
    answer = owner.post("/v1/sandboxes", json={**SHAPE, "replicate": True}, headers=on_n6)
    assert answer.status_code == 201, answer.text
    kept = answer.json()
    assert kept["replicate"] is True
    plain = owner.post("/v1/sandboxes", json=SHAPE, headers=on_n6).json()
    answer = owner.post("/v1/sandboxes", json={**SHAPE, "replicate_memory": True}, headers=on_n6)
    assert answer.status_code == 201, answer.text
    frozen = answer.json()
    assert frozen["replicate"] is True and frozen["replicate_memory"] is True
    assert kept["replicate_memory"] is False
    assert fleet.node_of(kept["id"]) == fleet.node_of(plain["id"]) == "n6"
    assert fleet.node_of(frozen["id"]) == "n6"
    run(owner, frozen["id"], COUNTER)
    run(owner, frozen["id"], "echo 'on the disk' > /root/frozen.txt")
    began = started(owner, frozen["id"])
    live = wait_for(  # a live snapshot on the period: memory kept, the guest paused for it
        lambda: (got := replica(owner, frozen["id"]))["memory"] and got,
        timeout=REPLICA_INTERVAL * 24,
        what="a replica with memory of the running sandbox",
    )
    assert live["node"] not in (None, "n6") and live["replicate_memory"] is True, live
    assert float(str(live["paused_ms"])) > 0, live
    assert owner.get(f"/v1/sandboxes/{frozen['id']}").json()["state"] == "running"
    ticking = counter(owner, frozen["id"])
    time.sleep(0.6)
    at_pause = counter(owner, frozen["id"])  # the counter has gone on since: at most this
    assert at_pause > ticking > 1  # it ran on after the copy
    paused_at = time.time()
    paused = owner.post(f"/v1/sandboxes/{frozen['id']}/pause")
    assert paused.status_code == 200 and paused.json()["state"] == "paused", paused.text
    with_memory = replica(owner, frozen["id"])  # refreshed by the pause, with its memory
    assert with_memory["memory"] is True and taken(with_memory) >= paused_at - 1, with_memory
    assert with_memory["paused_ms"] is None  # a paused guest is no pause of the copy's

    run(owner, kept["id"], "echo 'written before the stop' > /root/kept.txt")
    wrote = time.time()

    stopped = owner.post(f"/v1/sandboxes/{kept['id']}/stop")
    assert stopped.status_code == 200 and stopped.json()["state"] == "stopped", stopped.text
    copy = replica(owner, kept["id"])
    assert copy["node"] not in (None, "n6") and taken(copy) >= wrote - 1, copy
    assert not list((fleet.node_root / "n6" / "snapshots").glob("snap-*"))  # none left home
    resumed = owner.post(f"/v1/sandboxes/{kept['id']}/resume")
    assert resumed.status_code == 200 and resumed.json()["state"] == "running", resumed.text

    fleet.cluster.kill("n6")
    back = wait_for(  # until Ray reports n6 dead, its sandboxes' node does not answer
        lambda: (
            (got := owner.get(f"/v1/sandboxes/{kept['id']}").json()).get("state") == "recovered"
            and got
        ),
        timeout=120,
        what="the replicated sandbox to come back",
    )
    recovery = back["recovery"]
    assert recovery["from_node"] == "n6" and "n6" in recovery["reason"], recovery
    assert recovery["state"] == "stopped"  # from a copy of its disk alone
    assert recovery["node"] not in ("n6", None) and float(recovery["replica_age_seconds"]) >= 0
    assert fleet.vm_dir(recovery["node"], kept["id"]).exists()
    lost = owner.get(f"/v1/sandboxes/{plain['id']}").json()  # the control
    assert lost["state"] == "lost" and "n6" in lost["error"], lost
    listed = {s["id"]: s["state"] for s in owner.get("/v1/sandboxes").json()["sandboxes"]}
    assert listed[kept["id"]] == "recovered" and listed[plain["id"]] == "lost"
    events = owner.get(f"/v1/sandboxes/{kept['id']}/events").json()["events"]
    said = [e["data"] for e in events if e["type"] == "recovered"]
    assert said and said[0]["from_node"] == "n6" and "replica_age_seconds" in said[0], events

    again = owner.post(f"/v1/sandboxes/{kept['id']}/resume")
    assert again.status_code == 200 and again.json()["state"] == "running", again.text
    assert run(owner, kept["id"], "cat /root/kept.txt")["stdout"] == "written before the stop\n"
    shown = owner.get(f"/v1/sandboxes/{kept['id']}").json()
    assert shown["state"] == "running" and shown["recovery"] is None

    # the sandbox whose replica kept its memory: back paused, and on from where it was
    came = wait_for(
        lambda: (
            (got := owner.get(f"/v1/sandboxes/{frozen['id']}").json()).get("state") == "recovered"
            and got
        ),
        timeout=120,
        what="the sandbox with a replica of its memory to come back",
    )
    assert came["recovery"]["state"] == "paused" and came["recovery"]["from_node"] == "n6", came
    assert fleet.vm_dir(came["recovery"]["node"], frozen["id"]).exists()
    events = owner.get(f"/v1/sandboxes/{frozen['id']}/events").json()["events"]
    said = [e["data"] for e in events if e["type"] == "recovered"]
    assert said and said[0]["state"] == "paused", events
    thawed = owner.post(f"/v1/sandboxes/{frozen['id']}/resume")
    assert thawed.status_code == 200 and thawed.json()["state"] == "running", thawed.text
    assert started(owner, frozen["id"]) == began  # the same process, not a new one
    after = counter(owner, frozen["id"])
    assert after >= at_pause, (at_pause, after)  # counting on, not from 1 again
    time.sleep(0.6)
    assert counter(owner, frozen["id"]) > after  # and still counting
    assert run(owner, frozen["id"], "cat /root/frozen.txt")["stdout"] == "on the disk\n"
    assert owner.get(f"/v1/sandboxes/{frozen['id']}").json()["recovery"] is None
    assert owner.delete(f"/v1/sandboxes/{frozen['id']}").status_code == 204

    gone = owner.post(f"/v1/sandboxes/{plain['id']}/exec", json={"command": "true"})
    assert gone.status_code == 410 and gone.json()["error"]["code"] == "sandbox_lost"
    assert owner.delete(f"/v1/sandboxes/{plain['id']}").status_code == 204
    assert owner.delete(f"/v1/sandboxes/{kept['id']}").status_code == 204
