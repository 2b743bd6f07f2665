"""The fleet on a real Ray cluster (collected by `tests/integration/test_fleet.py` only,
inside a loopback-only network namespace)."""

from __future__ import annotations

import time

import httpx2
import pytest
from websockets.sync.client import connect

from cella import Client, errors
from cella.sdk import Sandbox
from tests.fleet.conftest import NODES, QUOTA, SHAPE, Fleet
from tests.integration.test_ports import SERVERS


def create(client: httpx2.Client, **body: object) -> dict[str, object]:
    answer = client.post("/v1/sandboxes", json={**SHAPE, **body})
    assert answer.status_code == 201, answer.text
    return dict(answer.json())


def run(client: httpx2.Client, sandbox_id: str, command: str) -> dict[str, object]:
    answer = client.post(f"/v1/sandboxes/{sandbox_id}/exec", json={"command": command})
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def delete_all(client: httpx2.Client) -> None:
    for sb in client.get("/v1/sandboxes").json()["sandboxes"]:
        client.delete(f"/v1/sandboxes/{sb['id']}")


def test_every_node_joined_with_its_daemon(fleet: Fleet) -> None:
    status = fleet.admin.get("/v1/fleet").json()
    assert sorted(n["name"] for n in status["nodes"]) == sorted(NODES)
    for node in status["nodes"]:
        assert node["healthy"], node
        assert node["capacity"]["memory_mib"] == 768
        assert "default" in node["templates"]
    capacity = fleet.admin.get("/v1/capacity").json()
    assert capacity["memory_mib"] == 768 * len(NODES)


def test_creates_spread_over_the_nodes_by_free_capacity(
    fleet: Fleet, tenant: httpx2.Client
) -> None:
    made = [create(tenant) for _ in NODES]
    assert sorted(fleet.node_of(str(sb["id"])) for sb in made) == sorted(NODES)
    status = fleet.admin.get("/v1/fleet").json()
    for node in status["nodes"]:
        assert node["capacity"]["memory_mib_committed"] == 256, node
    delete_all(tenant)


def test_every_call_on_a_sandbox_goes_to_its_node(fleet: Fleet, tenant: httpx2.Client) -> None:
    """The SDK, pointed at the gateway, drives a sandbox on whichever node it landed on."""
    key = tenant.headers["authorization"].split()[1]
    with Client(fleet.gateway.url, key) as client:
        sb = client.create(memory_mib=256, labels={"team": "red"})
        node = fleet.node_of(sb.id)
        assert sb.exec("echo hi").stdout == b"hi\n"
        streamed = list(sb.exec_stream("for i in 1 2 3; do echo $i; sleep 0.1; done"))
        assert b"".join(e.bytes for e in streamed if e.type == "stdout") == b"1\n2\n3\n"
        sb.files.write("/root/a.txt", "through the gateway")
        assert sb.files.read("/root/a.txt") == b"through the gateway"
        assert "a.txt" in [f.name for f in sb.files.list("/root")]
        blob = bytes(range(256)) * 4096  # 1 MiB streamed up and down
        sb.files.write("/root/blob", blob)
        assert b"".join(sb.files.read_stream("/root/blob")) == blob
        assert [s.id for s in client.list(labels={"team": "red"})] == [sb.id]
        sb.files.write("/srv/servers.py", SERVERS, parents=True)
        sb.files.write("/srv/hello.txt", "hello from the guest\n")
        sb.exec("cd /srv && nohup python3 servers.py >/tmp/servers.log 2>&1 &")
        ready = "import socket; [socket.create_connection(('127.0.0.1', p)) for p in (8000, 8001)]"
        for _ in range(100):
            if sb.exec(["python3", "-c", ready]).exit_code == 0:
                break
            time.sleep(0.2)
        exposed = sb.expose(8000)
        assert exposed.url.startswith(fleet.gateway.url)  # the gateway's address, not the node's
        got = httpx2.get(
            f"{exposed.url}/hello.txt", headers={"X-Cella-Service-Token": exposed.token}
        )
        assert got.status_code == 200 and got.text == "hello from the guest\n"
        assert httpx2.get(f"{exposed.url}/hello.txt").status_code == 403
        chat = sb.expose(8001)
        ws_url = chat.url.replace("http://", "ws://") + "/chat"
        with connect(ws_url, additional_headers={"X-Cella-Service-Token": chat.token}) as ws:
            ws.send("hi")
            assert ws.recv() == "echo:hi"
        assert sb.usage().memory_mib == 256
        sb.pause()
        assert sb.refresh().state == "paused"
        sb.resume()
        sb.stop()
        assert sb.refresh().state == "stopped"
        sb.resume()
        assert sb.files.read("/root/a.txt") == b"through the gateway"
        types = {e.type for e in sb.events()}
        assert {"exec", "stopped", "paused"} <= types, types
        assert fleet.node_of(sb.id) == node  # it never moved
        # another tenant cannot reach it through the gateway (the control: its owner can)
        other_key = fleet.admin.post("/v1/keys", json={"tenant": "umbrella"}).json()["key"]
        with Client(fleet.gateway.url, other_key) as other:
            with pytest.raises(errors.NotFound):
                other.get(sb.id)
            with pytest.raises(errors.NotFound):
                Sandbox(other, sb.info).exec("true")
        assert client.get(sb.id).id == sb.id
        sb.delete()
        with pytest.raises(errors.NotFound):
            client.get(sb.id)
        assert not fleet.vm_dir(node, sb.id).exists()


def test_a_snapshot_forks_on_other_nodes_shipped_once_then_cached(
    fleet: Fleet, tenant: httpx2.Client
) -> None:
    key = tenant.headers["authorization"].split()[1]
    with Client(fleet.gateway.url, key) as client:
        sb = client.create(memory_mib=256)
        origin = fleet.node_of(sb.id)
        sb.files.write("/root/state.txt", "prepared once")
        sb.exec("sh -c 'sleep 1000 >/dev/null 2>&1 &'")
        snap = sb.snapshot("prepared")
        assert fleet.snapshot_dir(origin, snap.id).exists()
        others = [n for n in NODES if n != origin]
        assert not any(fleet.snapshot_dir(n, snap.id).exists() for n in others)
        # the origin has room for two more: four branches spill onto other nodes
        branches = snap.fork(4)
        where = [fleet.node_of(b.id) for b in branches]
        assert where.count(origin) == 2, where
        shipped_to = sorted(set(where) - {origin})
        assert shipped_to, where
        for b in branches:
            assert b.files.read("/root/state.txt") == b"prepared once"
            assert b"sleep 1000" in b.exec("ps -o args").stdout
        ram = {n: fleet.snapshot_dir(n, snap.id) / "ram" for n in shipped_to}
        mtimes = {n: p.stat().st_mtime_ns for n, p in ram.items()}
        for b in branches:
            b.delete()
        # forked there again: the cached copy is used as it is
        again = snap.fork(4)
        assert {fleet.node_of(b.id) for b in again} - {origin} <= set(shipped_to) | set(NODES)
        assert {n: p.stat().st_mtime_ns for n, p in ram.items()} == mtimes
        for b in again:
            b.delete()
        # a create from the snapshot by name, and the snapshot listed once
        restored = client.create(snapshot="prepared")
        assert restored.files.read("/root/state.txt") == b"prepared once"
        assert [s.id for s in client.snapshots()].count(snap.id) == 1
        restored.delete()
        sb.delete()
        status = fleet.admin.get("/v1/fleet").json()
        holding = sorted(n["name"] for n in status["nodes"] if snap.id in n["snapshots"])
        assert holding == sorted({origin, *shipped_to})
        snap.delete()
        assert not any(fleet.snapshot_dir(n, snap.id).exists() for n in NODES)


def test_a_fork_bigger_than_the_fleet_is_refused_whole(fleet: Fleet, tenant: httpx2.Client) -> None:
    sb = create(tenant)
    answer = tenant.post(f"/v1/sandboxes/{sb['id']}/fork", json={"count": 3 * len(NODES)})
    assert answer.status_code in (409, 429), answer.text
    live = [s for s in tenant.get("/v1/sandboxes").json()["sandboxes"] if s["state"] == "running"]
    assert [s["id"] for s in live] == [sb["id"]]  # nothing half made
    delete_all(tenant)


def test_quotas_hold_across_nodes(fleet: Fleet, tenant: httpx2.Client) -> None:
    made = [create(tenant) for _ in range(QUOTA)]
    assert len({fleet.node_of(str(s["id"])) for s in made}) > 1  # spread: no node saw them all
    over = tenant.post("/v1/sandboxes", json=SHAPE)
    assert over.status_code == 429, over.text
    assert over.json()["error"]["code"] == "quota_exceeded"
    # the control: another tenant still creates
    other_key = fleet.admin.post("/v1/keys", json={"tenant": "initech"}).json()["key"]
    with fleet.client(other_key) as other:
        fine = create(other)
        assert other.delete(f"/v1/sandboxes/{fine['id']}").status_code == 204
    tenant.delete(f"/v1/sandboxes/{made[0]['id']}")
    create(tenant)  # room again
    delete_all(tenant)


def test_a_gateway_restart_loses_nothing(fleet: Fleet, tenant: httpx2.Client) -> None:
    made = [create(tenant, name=f"keep-{i}") for i in range(2)]
    run(tenant, str(made[0]["id"]), "echo before > /root/mark")
    fleet.restart_gateway()
    listed = {s["id"]: s for s in tenant.get("/v1/sandboxes").json()["sandboxes"]}
    assert set(listed) == {s["id"] for s in made}
    assert all(s["state"] == "running" for s in listed.values())
    got = tenant.get(f"/v1/sandboxes/{made[0]['id']}/files/content", params={"path": "/root/mark"})
    assert got.content == b"before\n"
    delete_all(tenant)
