"""The fleet on a real Ray cluster (collected by `tests/integration/test_fleet.py` only,
inside a loopback-only network namespace)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import httpx2
import pytest
from langsmith.sandbox import ResourceNotFoundError, SandboxClient
from langsmith.sandbox import SandboxClientError as LangSmithError
from langsmith.sandbox._verify import SandboxTokenVerifier
from websockets.sync.client import connect

from cella import Client, errors
from cella.eval import Task, TaskResult
from cella.fleet.tls import trusting
from cella.sdk import Sandbox
from tests.daemon import Daemon
from tests.fleet.conftest import NODE_SETTINGS, NODES, QUOTA, SHAPE, Fleet
from tests.integration.test_langsmith import SERVER as LS_SERVER
from tests.integration.test_langsmith import WHOAMI
from tests.integration.test_ports import start_servers
from tests.raycluster import open_cluster, without_token


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
        assert node["proxy_running"] is True  # each node's egress proxy, as its health says
        assert "default" in node["templates"]
    capacity = fleet.admin.get("/v1/capacity").json()
    assert capacity["memory_mib"] == 768 * len(NODES)
    # the CLI shows the same, as JSON and as a table
    env = fleet.gateway.env()
    shown = subprocess.run(
        [sys.executable, "-m", "cella.cli", "fleet", "status", "--json"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert sorted(n["name"] for n in json.loads(shown.stdout)["nodes"]) == sorted(NODES)
    table = subprocess.run(
        [sys.executable, "-m", "cella.cli", "fleet", "status"],
        env={**env, "COLUMNS": "120"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert all(name in table.stdout for name in NODES)
    assert f"{len(NODES)}/{len(NODES)} nodes up" in table.stderr


def test_bad_input_gets_a_clear_error_from_the_gateway(fleet: Fleet, tenant: httpx2.Client) -> None:
    cases = [
        (tenant.post("/v1/sandboxes", content=b"{not json"), 400, "invalid_argument"),
        (tenant.post("/v1/sandboxes", json={"memory_mib": 1}), 400, "invalid_argument"),
        (tenant.post("/v1/sandboxes", json=[1]), 400, "invalid_argument"),
        (tenant.get("/v1/sandboxes/sb-0000000000000000"), 404, "not_found"),
        (tenant.post("/v1/snapshots/snap-0000000000000000/fork", json={}), 404, "not_found"),
        (tenant.get("/v1/fleet"), 403, "permission_denied"),
        (httpx2.get(f"{fleet.gateway.url}/v1/sandboxes"), 401, "unauthenticated"),
        (fleet.client("ck_wrong").get("/v1/sandboxes"), 401, "unauthenticated"),
    ]
    for answer, status, code in cases:
        assert answer.status_code == status, answer.text
        assert answer.json()["error"]["code"] == code, answer.text
    # the LangSmith API takes its own header, also on the gateway
    assert tenant.get("/v2/sandboxes/boxes").status_code == 401
    # and the control: the same client gets through where it may
    assert tenant.get("/v1/sandboxes").status_code == 200


def join_as_driver(address: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`ray.init` of a driver in a process of its own; prints how many nodes it sees."""
    code = f"import ray; ray.init(address={address!r}); print('nodes', len(ray.nodes()))"
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240
    )


def test_the_cluster_refuses_a_client_without_its_token(fleet: Fleet) -> None:
    """Ray's token authentication is on: a driver without the cluster's token, or with a
    wrong one, is refused by the GCS; the same driver with the token joins."""
    address = fleet.cluster.address
    for env in (
        without_token(dict(os.environ)),
        {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64},
    ):
        refused = join_as_driver(address, env)
        assert refused.returncode != 0, refused.stdout
        assert "Authentication token is missing or incorrect" in refused.stderr, refused.stderr
    joined = join_as_driver(address, dict(os.environ))  # control: the token, the same call
    assert joined.returncode == 0, joined.stderr[-3000:]
    assert int(joined.stdout.split()[-1]) > len(NODES), joined.stdout  # the head and nodes


def test_node_daemons_hold_no_ray_token(fleet: Fleet) -> None:
    """The node daemon (and so its VMs' processes) never holds the cluster's token; its
    actor's worker, which starts it, does."""
    token = f"RAY_AUTH_TOKEN={os.environ['RAY_AUTH_TOKEN']}".encode()
    for name in NODES:
        daemon = int((fleet.node_root / name / "node.pid").read_text())
        stat = Path(f"/proc/{daemon}/stat").read_text()
        worker = int(stat.rsplit(")", 1)[1].split()[1])
        assert token in Path(f"/proc/{worker}/environ").read_bytes().split(b"\0")  # control
        environ = Path(f"/proc/{daemon}/environ").read_bytes().split(b"\0")
        assert not [v for v in environ if v.startswith(b"RAY_AUTH_TOKEN")], name


def test_a_cluster_without_token_auth_is_joined_only_when_allowed(tmp_path: Path) -> None:
    """A cluster that answers without a token: the gateway refuses to start on it, and a
    node daemon refuses to run on it, unless `ray_allow_unauthenticated` says so (the
    gateway's flag, a node's `cella/ray_allow_unauthenticated` label)."""
    nodes = {
        "o1": NODE_SETTINGS,
        "o2": {**NODE_SETTINGS, "ray_allow_unauthenticated": "true"},
    }
    # the gateway as such a cluster's own drivers are: no token, authentication off
    tokenless = ["env", "--unset=RAY_AUTH_TOKEN", "RAY_AUTH_MODE=disabled"]
    with open_cluster(nodes) as address:
        args = ["--ray", address, "--node-root", str(tmp_path / "nodes")]
        refused = Daemon(tmp_path / "refused", wrap=tokenless, args=args)
        try:
            with pytest.raises(RuntimeError, match="ray_allow_unauthenticated"):
                refused.start(timeout=240)
        finally:
            refused.stop()
        assert "answers without a token" in refused.log.read_text()
        allowed = Daemon(
            tmp_path / "allowed", wrap=tokenless, args=[*args, "--ray-allow-unauthenticated"]
        ).start(timeout=240)
        try:
            admin = httpx2.Client(
                base_url=allowed.url,
                headers={"authorization": f"Bearer {allowed.admin_key}"},
                timeout=60,
            )
            shown = {n["name"]: n for n in admin.get("/v1/fleet").json()["nodes"]}
            assert shown["o2"]["healthy"], shown  # control: the node that allows it joined
            assert not shown["o1"]["healthy"], shown
            assert "ray_allow_unauthenticated" in shown["o1"]["reason"], shown
            assert not (tmp_path / "nodes" / "o1" / "node.pid").exists()  # no daemon ran
        finally:
            allowed.stop()


def test_creates_spread_over_the_nodes_by_free_capacity(
    fleet: Fleet, tenant: httpx2.Client
) -> None:
    made = [create(tenant) for _ in NODES]
    assert sorted(fleet.node_of(str(sb["id"])) for sb in made) == sorted(NODES)
    status = fleet.admin.get("/v1/fleet").json()
    for node in status["nodes"]:
        assert node["capacity"]["memory_mib_committed"] == 256, node
    # the gateway's /metrics: every node's creates, each labelled with its node
    metrics = fleet.admin.get("/metrics").text
    for name in NODES:
        assert f'cella_fleet_node_up{{node="{name}"}} 1.0' in metrics
        line = f'cella_creates_total{{node="{name}",origin='
        assert any(x.startswith(line) and 'tenant="acme"' in x for x in metrics.splitlines())
    assert tenant.get("/metrics").status_code == 403  # a tenant's key: not the fleet's counts
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
        start_servers(sb)
        exposed = sb.expose(8000)
        assert exposed.url.startswith(fleet.gateway.url)  # the gateway's address, not the node's
        got = httpx2.get(
            f"{exposed.url}/hello.txt", headers={"X-Cella-Service-Token": exposed.token}
        )
        assert got.status_code == 200 and got.text == "hello from the guest\n"
        assert httpx2.get(f"{exposed.url}/hello.txt").status_code == 403
        check_what_the_node_signs(fleet, sb, key)
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


def check_what_the_node_signs(fleet: Fleet, sb: Sandbox, key: str) -> None:
    """A download link and a login-mode URL made through the gateway are at the gateway's
    address, relayed to the node, and what the node signs verifies against the gateway's
    JWKS (the union of the nodes' keys)."""
    sb.files.write("/root/out.txt", "linked")
    link = sb.files.download_url("/root/out.txt", expires_in_seconds=120)
    assert link.url.startswith(fleet.gateway.url)
    assert httpx2.get(link.url).text == "linked"  # no key
    assert httpx2.get(link.url.replace("out.txt", "a.txt")).status_code == 403
    sb.files.write("/srv/whoami.py", WHOAMI)
    sb.exec("nohup python3 /srv/whoami.py >/dev/null 2>&1 &")
    ready = "import socket; socket.create_connection(('127.0.0.1', 8010))"
    wait_for(lambda: sb.exec(["python3", "-c", ready]).exit_code == 0, what="whoami")
    login = sb.login_url(8010)
    assert login.url.startswith(fleet.gateway.url)
    assert httpx2.get(f"{login.url}/").status_code == 401  # no key
    got = httpx2.get(f"{login.url}/", headers={"authorization": f"Bearer {key}"})
    seen = got.json()["headers"]
    (token,) = seen["x-langsmith-user-token"]
    (host,) = seen["host"]
    verifier = SandboxTokenVerifier(api_url=fleet.gateway.url)
    user = verifier.verify_user_token(token, audience=host)
    assert user.subject == seen["x-langsmith-user-id"][0]
    acme = {k["id"] for k in fleet.admin.get("/v1/keys").json() if k["tenant"] == "acme"}
    assert user.subject in acme  # a key of the gateway's caller, not the node's admin key


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
        where_again = {fleet.node_of(b.id) for b in again}
        assert where_again - {origin}, where_again  # spilled again: the cache is looked at
        assert where_again <= {origin, *shipped_to}, (where_again, shipped_to)  # holders win
        assert {n: p.stat().st_mtime_ns for n, p in ram.items()} == mtimes  # not shipped again
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
    """Within the tenant's quota but beyond the fleet's room: 512 MiB branches fit once on
    each other node and not beside the parent, so 3 are refused and 2 are made."""
    sb = create(tenant, memory_mib=512)
    snapshots_before = {s["id"] for s in tenant.get("/v1/snapshots").json()["snapshots"]}
    answer = tenant.post(f"/v1/sandboxes/{sb['id']}/fork", json={"count": 3})
    assert answer.status_code == 409 and answer.json()["error"]["code"] == "capacity_exceeded", (
        answer.text
    )
    live = [s for s in tenant.get("/v1/sandboxes").json()["sandboxes"] if s["state"] == "running"]
    assert [s["id"] for s in live] == [sb["id"]]  # nothing half made
    snapshots_after = {s["id"] for s in tenant.get("/v1/snapshots").json()["snapshots"]}
    assert snapshots_after == snapshots_before  # nor a snapshot left behind
    made = tenant.post(f"/v1/sandboxes/{sb['id']}/fork", json={"count": 2})  # the control
    assert made.status_code == 201, made.text
    assert {fleet.node_of(b["id"]) for b in made.json()["sandboxes"]} == set(NODES) - {
        fleet.node_of(str(sb["id"]))
    }
    delete_all(tenant)
    for snap in tenant.get("/v1/snapshots").json()["snapshots"]:
        tenant.delete(f"/v1/snapshots/{snap['id']}")


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
    fleet.gateway.kill9()  # no clean shutdown: what it knows is rebuilt from the nodes
    fleet.gateway.start(timeout=120)
    listed = {s["id"]: s for s in tenant.get("/v1/sandboxes").json()["sandboxes"]}
    assert set(listed) == {s["id"] for s in made}
    assert all(s["state"] == "running" for s in listed.values())
    got = tenant.get(f"/v1/sandboxes/{made[0]['id']}/files/content", params={"path": "/root/mark"})
    assert got.content == b"before\n"
    delete_all(tenant)


def test_the_langsmith_sdk_through_the_gateway(fleet: Fleet, tenant: httpx2.Client) -> None:
    """The official LangSmith SDK, pointed at the gateway, drives boxes on the nodes: by name
    on the control plane, by id on the data plane (HTTP and WebSockets), snapshots."""
    key = tenant.headers["authorization"].split()[1]
    client = SandboxClient(api_endpoint=f"{fleet.gateway.url}/api/v2/sandboxes", api_key=key)
    try:
        with client.sandbox(name="ls-box") as box:
            assert box.dataplane_url.startswith(fleet.gateway.url)  # not the node's address
            node = fleet.node_of(box.id)
            seen: list[str] = []
            result = box.run("for i in 1 2; do echo out$i; done", on_stdout=seen.append)
            assert result.stdout == "out1\nout2\n" and "".join(seen) == result.stdout
            box.write("/srv/index.txt", "served from the guest\n")
            assert box.read("/srv/index.txt") == b"served from the guest\n"
            box.run(LS_SERVER)
            wait = "(echo > /dev/tcp/127.0.0.1/8000) 2>/dev/null && break; sleep 0.1"
            box.run(f"for i in $(seq 100); do {wait}; done")
            with box.tunnel(remote_port=8000, local_port=0) as tunnel:  # a WebSocket, relayed
                got = httpx.get(f"http://127.0.0.1:{tunnel.local_port}/index.txt", timeout=30)
                assert got.text == "served from the guest\n"
            with pytest.raises(LangSmithError, match="ls-box") as taken:  # unique in the fleet
                client.create_sandbox(name="ls-box")
            assert taken.value.__cause__.response.status_code == 409
            snap = box.capture_snapshot("ls-env")
            assert snap.status == "ready"
            names = [b.name for b in client.list_sandboxes()]
            assert "ls-box" in names
            with client.sandbox(snapshot="ls-env", name="from-env") as booted:
                assert booted.read("/srv/index.txt") == b"served from the guest\n"
            assert fleet.node_of(box.id) == node
        assert [s.id for s in client.list_snapshots(name_contains="ls-env")] == [snap.id]
        client.delete_snapshot(snap.id)
        with pytest.raises(ResourceNotFoundError):
            client.get_sandbox("ls-box")
    finally:
        client.close()
        delete_all(tenant)


def test_a_read_only_key_wakes_nothing_through_the_gateway(
    fleet: Fleet, tenant: httpx2.Client
) -> None:
    """The gateway relays a read-only caller as read-only: a data-plane GET on a stopped
    box (waking it would commit RAM and a quota slot on its node) is refused there."""
    key = tenant.headers["authorization"].split()[1]
    made = fleet.admin.post("/v1/keys", json={"tenant": "acme", "read_only": True})
    read_only = made.json()["key"]
    client = SandboxClient(api_endpoint=f"{fleet.gateway.url}/api/v2/sandboxes", api_key=key)
    try:
        with client.sandbox(name="asleep") as box:
            box.write("/tmp/note.txt", "zzz")
            box.stop()
            state = lambda: tenant.get(f"/v1/sandboxes/{box.id}").json()["state"]  # noqa: E731
            wait_for(lambda: state() == "stopped", what="the box to stop")
            url, note = f"{box.dataplane_url}/download", {"path": "/tmp/note.txt"}
            refused = httpx.get(url, params=note, headers={"X-Api-Key": read_only}, timeout=60)
            assert refused.status_code == 403, refused.text
            assert state() == "stopped"
            # control: the tenant's read-write key wakes it with the same GET
            woken = httpx.get(url, params=note, headers={"X-Api-Key": key}, timeout=120)
            assert (woken.status_code, woken.content) == (200, b"zzz")
            assert state() == "running"
    finally:
        client.close()
        delete_all(tenant)


def node_has_secret(fleet: Fleet, node: str, tenant: str, name: str) -> bool:
    url = next(n["url"] for n in fleet.admin.get("/v1/fleet").json()["nodes"] if n["name"] == node)
    assert url.startswith("https://")  # node daemons speak TLS only
    key = (fleet.node_root / node / "admin.key").read_text().strip()
    got = httpx2.get(
        f"{url}/v1/secrets/{name}",
        headers={"authorization": f"Bearer {key}", "x-cella-tenant": tenant},
        verify=trusting((fleet.node_root / node / "tls" / "node.crt").read_text()),
    )
    return got.status_code == 200


def test_node_daemons_speak_tls_with_their_own_certificate(fleet: Fleet) -> None:
    for node in fleet.admin.get("/v1/fleet").json()["nodes"]:
        cert = (fleet.node_root / node["name"] / "tls" / "node.crt").read_text()
        assert node["url"].startswith("https://127.0.0.1:")
        assert httpx2.get(f"{node['url']}/v1/health", verify=trusting(cert)).status_code == 200
        # not trusted by default: it is the node's own
        with pytest.raises(httpx2.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx2.get(f"{node['url']}/v1/health", timeout=5)
        # and no API in clear on that port
        with pytest.raises(httpx2.RemoteProtocolError, match="without sending a response"):
            httpx2.get(node["url"].replace("https", "http") + "/v1/health", timeout=5)


def test_no_tenant_rule_opens_a_node(fleet: Fleet, tenant: httpx2.Client) -> None:
    """The gateway tells every node the fleet's addresses; a tenant's rule naming one is
    refused through the gateway, before any VM is made."""
    for node in fleet.admin.get("/v1/fleet").json()["nodes"]:
        told = json.loads((fleet.node_root / node["name"] / "egress" / "fleet-addresses.json")
                          .read_text())  # fmt: skip
        assert "127.0.0.1" in told, told  # every node of this cluster is there
        key = (fleet.node_root / node["name"] / "admin.key").read_text().strip()
        boundary = httpx2.get(
            f"{node['url']}/v1/egress/boundary",
            headers={"authorization": f"Bearer {key}"},
            verify=trusting((fleet.node_root / node["name"] / "tls" / "node.crt").read_text()),
        ).json()
        assert set(told) <= set(boundary["protected"]), (told, boundary)
    before = tenant.get("/v1/sandboxes").json()["sandboxes"]
    for rule in ("127.0.0.1:8420", "169.254.169.254", "10.0.0.0/8"):
        refused = tenant.post("/v1/sandboxes", json={**SHAPE, "network": {"allow": [rule]}})
        assert refused.status_code == 403, refused.text
        assert refused.json()["error"]["code"] == "destination_forbidden"
    assert tenant.get("/v1/sandboxes").json()["sandboxes"] == before  # nothing was made
    # control: a public address is a tenant's to open
    made = create(tenant, network={"allow": ["93.184.216.34:443"]})
    assert made["network"]["allow"] == ["93.184.216.34:443"]
    tenant.delete(f"/v1/sandboxes/{made['id']}")


def test_secrets_are_kept_on_every_node(fleet: Fleet, tenant: httpx2.Client) -> None:
    value = "s3cr3t-value-never-returned"
    for name in ("api", "kept"):
        put = tenant.put(f"/v1/secrets/{name}", json={"value": value, "hosts": ["api.test"]})
        assert put.status_code == 200, put.text
    listed = tenant.get("/v1/secrets")
    assert {s["name"] for s in listed.json()["secrets"]} == {"api", "kept"}
    assert value not in listed.text and value not in tenant.get("/v1/secrets/api").text
    assert all(node_has_secret(fleet, n, "acme", "api") for n in NODES)
    assert not node_has_secret(fleet, NODES[0], "umbrella", "api")  # the tenant's only
    # one rotation seals the gateway's copy and every node's under new keys
    keys = {n: (fleet.node_root / n / "secrets.key").read_bytes() for n in NODES}
    rotated = fleet.admin.post("/v1/secrets-key/rotate")
    assert rotated.status_code == 200 and rotated.json()["resealed"] >= 2, rotated.text
    assert all((fleet.node_root / n / "secrets.key").read_bytes() != keys[n] for n in NODES)
    assert tenant.post("/v1/secrets-key/rotate").status_code == 403  # admin only
    assert all(node_has_secret(fleet, n, "acme", "api") for n in NODES)
    made = [create(tenant, secrets={"API_TOKEN": "api"}) for _ in NODES]
    assert sorted(fleet.node_of(str(m["id"])) for m in made) == sorted(NODES)
    for m in made:
        seen = run(tenant, str(m["id"]), 'printf %s "$API_TOKEN"')["stdout"]
        assert seen and seen != value  # a placeholder, on whichever node
    delete_all(tenant)
    assert tenant.delete("/v1/secrets/api").status_code == 204
    assert not any(node_has_secret(fleet, n, "acme", "api") for n in NODES)
    assert tenant.delete("/v1/secrets/api").status_code == 404


def answers_again(tenant: httpx2.Client, sandbox_id: str) -> bool:
    try:
        got = tenant.post(f"/v1/sandboxes/{sandbox_id}/exec", json={"command": "cat /root/mark"})
    except httpx2.HTTPError:
        return False
    return got.status_code == 200 and got.json()["stdout"] == "kept\n"


def test_a_node_daemon_that_dies_is_started_again(fleet: Fleet, tenant: httpx2.Client) -> None:
    """Its actor starts it again (same data directory: the running VM is adopted), and when
    the actor's worker dies, Ray restarts the actor, which starts the daemon again."""
    sb = create(tenant)
    sid = str(sb["id"])
    node = fleet.node_of(sid)
    run(tenant, sid, "echo kept > /root/mark")
    pidfile = fleet.node_root / node / "node.pid"
    first = int(pidfile.read_text())
    os.kill(first, signal.SIGKILL)  # the daemon crashes
    wait_for(lambda: answers_again(tenant, sid), timeout=90, what="the daemon to come back")
    second = int(pidfile.read_text())
    assert second != first
    worker = int(Path(f"/proc/{second}/stat").read_text().rsplit(")", 1)[1].split()[1])
    os.kill(worker, signal.SIGKILL)  # the actor's worker dies, and the daemon with it
    wait_for(lambda: not Path(f"/proc/{second}").exists(), timeout=10, what="the daemon to die")
    wait_for(lambda: answers_again(tenant, sid), timeout=120, what="the actor to come back")
    assert int(pidfile.read_text()) not in (first, second)
    status = fleet.admin.get("/v1/fleet").json()
    assert all(n["healthy"] for n in status["nodes"]), status
    delete_all(tenant)


def wait_for(check: Callable[[], object], timeout: float = 60, what: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found := check():
            return found
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what or check}")


def test_a_node_killed_mid_eval(fleet: Fleet, tenant: httpx2.Client, tmp_path: Path) -> None:
    """Last: it takes a node away. Its sandboxes turn lost; the eval's tasks that ran there
    run again elsewhere and the result set is complete; the rest of the fleet goes on."""
    fleet.cluster.add("n4", **NODE_SETTINGS)
    wait_for(
        lambda: any(
            n["name"] == "n4" and n["healthy"] for n in fleet.admin.get("/v1/fleet").json()["nodes"]
        ),
        what="n4 to join",
    )
    assert node_has_secret(fleet, "n4", "acme", "kept")  # pushed to the node as it joined
    key = tenant.headers["authorization"].split()[1]
    base = create(tenant)
    run(tenant, str(base["id"]), "mkdir -p /root/work && echo ready > /root/work/ok")
    snap = tenant.post(f"/v1/sandboxes/{base['id']}/snapshots", json={"name": "evalbase"})
    assert snap.status_code == 201, snap.text
    tenant.delete(f"/v1/sandboxes/{base['id']}")
    doomed = tenant.post("/v1/sandboxes", json=SHAPE, headers={"X-Cella-Node": "n4"}).json()
    assert fleet.node_of(doomed["id"]) == "n4"
    survivor = create(tenant)
    assert fleet.node_of(str(survivor["id"])) != "n4"

    tasks = [
        Task(
            id=f"t{i}",
            check="sleep 3; test -f /root/work/ok",
            workdir="/root/work",
            artifacts=["/root/work/ok"],
        )
        for i in range(7)
    ] + [Task(id="fails", check="sleep 3; false", workdir="/root/work")]
    tasks_file = tmp_path / "tasks.jsonl"
    tasks_file.write_text("".join(t.model_dump_json() + "\n" for t in tasks))
    # the CLI, as documented: cella eval run TASKS --snapshot S --ray ADDRESS --parallel N.
    # Two at a time: a task Ray retries after n4 dies may create its sandbox before the
    # gateway's poll marks n4's lost, and doomed + survivor + 2 + 1 stays within the quota
    command = [
        sys.executable, "-m", "cella.cli", "eval", "run", str(tasks_file),
        "--snapshot", snap.json()["id"], "--ray", fleet.cluster.address, "--parallel", "2",
        "--out", str(tmp_path / "eval"), "--name", "fleet-eval", "--json",
    ]  # fmt: skip
    runner = subprocess.Popen(
        command,
        env=fleet.gateway.env(key),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    # kill n4 while one of the eval's sandboxes runs there
    n4_vms = fleet.node_root / "n4" / "vms"
    wait_for(
        lambda: [d for d in os.listdir(n4_vms) if d != doomed["id"]],
        timeout=120,
        what="an eval task on n4",
    )
    fleet.cluster.kill("n4")
    out, err = runner.communicate(timeout=600)
    assert runner.returncode == 0, err[-3000:]
    results = [TaskResult.model_validate(r) for r in json.loads(out)["results"]]

    assert [r.task_id for r in results] == [t.id for t in tasks]  # complete, in order
    assert all(r.error is None for r in results), [(r.task_id, r.error) for r in results]
    assert [r.passed for r in results] == [True] * 7 + [False]
    assert all(r.node and r.node != "n4" for r in results)
    for r in results:
        assert r.trace and Path(r.trace).is_relative_to(tmp_path / "eval")
        assert '"type":"exec"' in Path(r.trace).read_text().replace(" ", "")
    assert len((tmp_path / "eval" / "results.jsonl").read_text().splitlines()) == len(tasks)
    for r in results[:7]:  # each task's artifact, collected from its node
        assert Path(r.artifacts["/root/work/ok"]).read_text() == "ready\n"
        assert Path(r.artifacts["/root/work/ok"]).is_relative_to(tmp_path / "eval")
    recorded = fleet.client(key).get("/v1/evals").json()["runs"]  # kept by the gateway
    kept = next(r for r in recorded if r["name"] == "fleet-eval")
    assert (kept["passed"], kept["failed"], kept["errors"]) == (7, 1, 0) and kept["finished_at"]

    lost = tenant.get(f"/v1/sandboxes/{doomed['id']}").json()
    assert lost["state"] == "lost" and "n4" in lost["error"], lost
    gone = tenant.post(f"/v1/sandboxes/{doomed['id']}/exec", json={"command": "true"})
    assert gone.status_code == 410 and gone.json()["error"]["code"] == "sandbox_lost"
    assert doomed["id"] in [s["id"] for s in tenant.get("/v1/sandboxes").json()["sandboxes"]]
    status = fleet.admin.get("/v1/fleet").json()
    n4 = next(n for n in status["nodes"] if n["name"] == "n4")
    assert not n4["healthy"] and "n4" in n4["reason"]
    assert status["lost_sandboxes"] >= 1
    # the rest of the fleet is undisturbed
    assert run(tenant, str(survivor["id"]), "echo still")["stdout"] == "still\n"
    after = create(tenant)
    assert fleet.node_of(str(after["id"])) != "n4"
    assert tenant.delete(f"/v1/sandboxes/{doomed['id']}").status_code == 204  # forgotten
    delete_all(tenant)


def test_a_node_lost_while_the_gateway_is_down(fleet: Fleet, tenant: httpx2.Client) -> None:
    """The gateway's view is rebuilt on start: a node that left while it was down (killed
    with it) turns its sandboxes lost; the other nodes' sandboxes are as they were."""
    fleet.cluster.add("n5", **NODE_SETTINGS)
    wait_for(
        lambda: any(
            n["name"] == "n5" and n["healthy"] for n in fleet.admin.get("/v1/fleet").json()["nodes"]
        ),
        what="n5 to join",
    )
    doomed = tenant.post("/v1/sandboxes", json=SHAPE, headers={"X-Cella-Node": "n5"}).json()
    assert fleet.node_of(doomed["id"]) == "n5"
    survivor = create(tenant)
    fleet.gateway.kill9()
    fleet.cluster.kill("n5")
    fleet.gateway.start(timeout=120)
    lost = wait_for(
        lambda: (
            (got := tenant.get(f"/v1/sandboxes/{doomed['id']}").json())["state"] == "lost" and got
        ),
        what="the sandbox of n5 to be lost",
    )
    assert "n5" in lost["error"], lost
    status = fleet.admin.get("/v1/fleet").json()
    n5 = next(n for n in status["nodes"] if n["name"] == "n5")
    assert not n5["healthy"] and "n5" in n5["reason"]
    assert run(tenant, str(survivor["id"]), "echo here")["stdout"] == "here\n"  # the control
    assert tenant.get(f"/v1/sandboxes/{survivor['id']}").json()["state"] == "running"
    tenant.delete(f"/v1/sandboxes/{doomed['id']}")
    delete_all(tenant)


def test_the_web_console_through_the_gateway(fleet: Fleet, tenant: httpx2.Client) -> None:
    """The gateway serves /ui: a session cookie from a key, the fleet's sandboxes through
    it, changes refused without the CSRF token (the browser tests run on one daemon)."""
    key = tenant.headers["authorization"].split()[1]
    sb = create(tenant)
    with httpx2.Client(base_url=fleet.gateway.url) as browser:
        assert browser.get("/ui/").status_code == 303
        login = browser.post("/ui/login", data={"key": key})
        assert login.status_code == 303 and "cella_session" in browser.cookies
        page = browser.get("/ui/")
        assert page.status_code == 200 and "app.js" in page.text
        assert "script-src 'self'" in page.headers["content-security-policy"]
        csrf = browser.get("/ui/session").json()["csrf"]
        listed = browser.get("/v1/sandboxes").json()["sandboxes"]
        assert [s["id"] for s in listed] == [sb["id"]]
        refused = browser.post(f"/v1/sandboxes/{sb['id']}/pause")
        assert refused.status_code == 403
        paused = browser.post(f"/v1/sandboxes/{sb['id']}/pause", headers={"x-csrf-token": csrf})
        assert paused.status_code == 200 and paused.json()["state"] == "paused"
    delete_all(tenant)
