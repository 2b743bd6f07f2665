"""The LangSmith SDK's whole surface through the fleet gateway (collected by
`tests/integration/test_fleet.py` with the other fleet checks, on the same cluster): what
works on one daemon works pointed at the gateway, the SDK unchanged, and what one daemon
refuses the gateway refuses too."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import httpx2
import pytest
from langsmith._client import Langsmith
from langsmith._exceptions import APIStatusError, NotFoundError
from langsmith.sandbox import (
    ResourceCreationError,
    SandboxClient,
    SandboxClientError,
    aws_auth,
    git_mount,
    mount_config,
    opaque_secret,
    proxy_config,
    workspace_secret,
)
from langsmith.sandbox._verify import SandboxTokenVerifier

from cella import Client
from cella.fleet.relay import NODE_HINT
from cella.fleet.tls import node_certificate, trusting
from tests.fleet.conftest import NODES, Fleet
from tests.fleet.outside import BUCKET, GIT_TOKEN, PASSWORD, S3_HOST, USER, Outside
from tests.integration.test_langsmith import WHOAMI

WAIT = 900  # seconds a build may take (TCG boots are slow)
SLOW = 240
MIB = 1 << 20
KEEPER = "nohup sleep 4242 >/dev/null 2>&1 &"
ALIVE = "pgrep -f 'sleep [4]242' >/dev/null && echo alive || echo gone"


def key_of(tenant: httpx2.Client) -> str:
    return tenant.headers["authorization"].split()[1]


@pytest.fixture
def client(fleet: Fleet, tenant: httpx2.Client) -> Iterator[SandboxClient]:
    c = SandboxClient(api_endpoint=f"{fleet.gateway.url}/api/v2/sandboxes", api_key=key_of(tenant))
    yield c
    c.close()
    for sb in tenant.get("/v1/sandboxes").json()["sandboxes"]:
        tenant.delete(f"/v1/sandboxes/{sb['id']}")


@pytest.fixture
def other(fleet: Fleet) -> Iterator[SandboxClient]:
    """Another tenant's key at the gateway."""
    key = fleet.admin.post("/v1/keys", json={"tenant": "initech"}).json()["key"]
    c = SandboxClient(api_endpoint=f"{fleet.gateway.url}/api/v2/sandboxes", api_key=key)
    yield c
    c.close()


def node_registries(fleet: Fleet, node: str, tenant: str = "acme") -> list[str]:
    """The names of the registries a node daemon holds for the tenant."""
    url = next(n["url"] for n in fleet.admin.get("/v1/fleet").json()["nodes"] if n["name"] == node)
    key = (fleet.node_root / node / "admin.key").read_text().strip()
    got = httpx2.get(
        f"{url}/v1/registries",
        headers={"authorization": f"Bearer {key}", "x-cella-tenant": tenant},
        verify=trusting((fleet.node_root / node / "tls" / "node.crt").read_text()),
    )
    assert got.status_code == 200, got.text
    return [r["name"] for r in got.json()["registries"]]


def another_node(fleet: Fleet, sandbox_id: str) -> str:
    return next(n for n in NODES if n != fleet.node_of(sandbox_id))


def test_registries_are_the_tenants_across_the_fleet(
    fleet: Fleet, client: SandboxClient, other: SandboxClient, outside: Outside
) -> None:
    """Registries are kept by the gateway (sealed, never returned); a build from a private
    image pulls with them on whichever node builds it, and the snapshot it makes boots on
    another node (shipped there)."""
    made = client.registries.create(
        name="team", url=outside.registry.host, username=USER, password=PASSWORD
    )
    wrong = client.registries.create(
        name="wrong", url=outside.registry.host, username=USER, password="not-it"
    )
    try:
        assert client.registries.retrieve("team").id == made.id
        assert sorted(r.name or "" for r in client.registries.list().items or []) == [
            "team",
            "wrong",
        ]

        async def listed() -> list[str]:
            async with client.to_async() as a:
                page = await a.registries.list(name_contains="tea")
                return [r.name or "" for r in page.items or []]

        assert asyncio.run(listed()) == ["team"]
        raw = httpx.get(
            f"{fleet.gateway.url}/api/v2/sandboxes/registries",
            headers={"X-Api-Key": client._api_key},
        )
        own = fleet.admin.get("/v1/registries", headers={"x-cella-tenant": "acme"})
        assert raw.status_code == 200 and own.status_code == 200, (raw.text, own.text)
        assert sorted(r["name"] for r in own.json()["registries"]) == ["team", "wrong"]
        assert PASSWORD not in raw.text + own.text and "password" not in own.text
        assert not any(node_registries(fleet, n) for n in NODES)  # until a build needs one
        # another tenant sees none of them
        assert (other.registries.list().items or []) == []
        with pytest.raises(NotFoundError, match=r"(?i)not found"):
            other.registries.retrieve("team")
        with pytest.raises(SandboxClientError, match=r"(?i)not found"):
            other.create_snapshot("theirs", outside.image, 1 << 30, registry_id=made.id)
        with pytest.raises(APIStatusError, match=r"AWS_ROLE"):
            client.registries.create(name="ecr", url="ecr.example", auth_type="AWS_ROLE")

        # the registry refuses a pull without its credentials, or with wrong ones...
        with pytest.raises(ResourceCreationError, match=r"(?i)unauthorized|authentication"):
            client.create_snapshot("no-login", outside.image, 1 << 30, timeout=WAIT)
        with pytest.raises(ResourceCreationError, match=r"(?i)unauthorized|authentication"):
            client.create_snapshot(
                "bad-login", outside.image, 1 << 30, registry_id=wrong.id, timeout=WAIT
            )
        # ...and the control: the tenant's registry pulls it
        snap = client.create_snapshot(
            "busybox", outside.image, 1 << 30, registry_id=made.id, timeout=WAIT
        )
        assert snap.status == "ready" and client.get_snapshot("busybox:1").id == snap.id
        assert [s.id for s in client.list_snapshots(name_contains="busybox")] == [snap.id]
        holders = [n for n in NODES if fleet.snapshot_dir(n, snap.id).exists()]
        assert len(holders) == 1, holders
        # a node that did not build it boots a box from it (shipped there), with the image's
        # USER, WORKDIR and ENV
        elsewhere = next(n for n in NODES if n not in holders)
        box = client.create_sandbox(
            snapshot="busybox:1", name="from-image", timeout=SLOW, headers={NODE_HINT: elsewhere}
        )
        assert fleet.node_of(box.id) == elsewhere
        r = box.run("echo $(id -u) $(pwd) $FOO; cat hello.txt", shell="/bin/sh")
        assert r.exit_code == 0, r.stderr
        assert r.stdout.split("\n")[0] == "1000 /app bar" and "from the upper layer" in r.stdout
        box.delete()
        with pytest.raises(SandboxClientError, match=r"(?i)not found|no snapshot"):
            other.create_sandbox(snapshot=snap.id, timeout=60)
        client.delete_snapshot(snap.id)
        assert not any(fleet.snapshot_dir(n, snap.id).exists() for n in NODES)
    finally:
        for name in ("team", "wrong"):
            client.registries.delete(name)
    assert (client.registries.list().items or []) == []
    assert not any(node_registries(fleet, n) for n in NODES)  # gone from the nodes too


def test_what_a_node_signs_verifies_at_the_gateway(
    fleet: Fleet, client: SandboxClient, outside: Outside
) -> None:
    """Download links, login-mode service URLs and proxy callbacks made through the gateway:
    at its address, and signed by the box's node with a key the gateway's JWKS publishes."""
    jwks = f"{fleet.gateway.url}/.well-known/jwks.json"
    ask = "http://callback.test/ask"
    proxy_config = {
        "access_control": {"allow_list": ["web.test"]},
        "rules": [{"name": "ask", "type": "callback", "match_hosts": ["web.test"],
                   "callback": {"url": ask}}],
    }  # fmt: skip
    with client.sandbox(name="signed", proxy_config=proxy_config, mem_bytes=256 * MIB) as box:
        # a download link at the gateway, opened without a key
        box.write("/root/report.csv", "a,b\n1,2\n")
        link = box.generate_download_url("/root/report.csv", expires_in_seconds=120)
        url = link.download_url
        assert url.startswith(fleet.gateway.url)
        got = httpx.get(url, timeout=60)
        assert got.status_code == 200 and got.content == b"a,b\n1,2\n"
        assert httpx.get(url.replace("report.csv", "other"), timeout=60).status_code == 403
        # a login-mode service URL: the guest's server verifies its user token at the gateway
        box.write("/srv/whoami.py", WHOAMI)
        box.run("nohup python3 /srv/whoami.py >/dev/null 2>&1 &")
        wait = "(echo > /dev/tcp/127.0.0.1/8010) 2>/dev/null && break; sleep 0.1"
        box.run(f"for i in $(seq 100); do {wait}; done")
        login = client.service("signed", 8010, access="restricted")
        assert login.url.startswith(fleet.gateway.url)
        assert httpx.get(login.url, timeout=60).status_code == 401
        seen = httpx.get(login.url, headers={"x-api-key": client._api_key}, timeout=60)
        assert seen.status_code == 200, seen.text
        headers = seen.json()["headers"]
        (token,) = headers["x-langsmith-user-token"]
        (host,) = headers["host"]
        user = SandboxTokenVerifier(api_url=fleet.gateway.url).verify_user_token(
            token, audience=host
        )
        assert user.subject == headers["x-langsmith-user-id"][0]
        # a proxy callback: asked, signed, verified against the gateway's JWKS
        outside.answers.append({"allow": True, "headers": {"X-From-Callback": "yes"}})
        before = len(outside.asked.requests)
        echoed = json.loads(box.run("curl -sS http://web.test/one").stdout)
        assert echoed["headers"]["x-from-callback"] == "yes"
        first = outside.asked.requests[before]
        verifier = SandboxTokenVerifier(jwks_url=jwks)
        called = verifier.verify_callback(body=first["body"], signature=first["signature"], aud=ask)
        assert called.identity.sandbox_id == box.id and called.identity.tenant_id == "acme"
        # the control: a refusal is one
        outside.answers.append({"allow": False, "reason": "not now"})
        assert "not now" in box.run("curl -sS http://web.test/two?fresh=1").stdout


def test_a_private_git_mount_through_the_gateway(
    fleet: Fleet, client: SandboxClient, tenant: httpx2.Client, outside: Outside
) -> None:
    """A create's mount_config and proxy_config go whole to the node: a private repository
    is cloned only with a header rule whose workspace secret (kept by the gateway and on
    every node) the guest never sees."""
    basic = base64.b64encode(f"x-access-token:{GIT_TOKEN}".encode()).decode()
    put = tenant.put("/v1/secrets/GITAUTH", json={"value": basic, "hosts": ["git.test"]})
    assert put.status_code == 200, put.text
    mounts = mount_config(mounts=[git_mount(
        id="private", mount_path="/work/private", remote_url="https://git.test/private.git",
        ref={"type": "branch", "name": "main"},
    )])  # fmt: skip
    allow = {"access_control": {"allow_list": ["git.test"]}}
    header = {"name": "Authorization", "type": "workspace_secret", "value": "Basic {GITAUTH}"}
    rule = {"name": "git", "match_hosts": ["git.test"], "headers": [header]}
    try:
        # without the rule the server wants credentials, and the create fails by the mount
        with pytest.raises(ResourceCreationError, match="mount 'private'"):
            client.create_sandbox(
                name="no-rule", mount_config=mounts, proxy_config=allow, mem_bytes=256 * MIB,
                timeout=SLOW,
            )  # fmt: skip
        with client.sandbox(
            name="cloned", mount_config=mounts, proxy_config={**allow, "rules": [rule]},
            mem_bytes=256 * MIB, timeout=SLOW,
        ) as box:  # fmt: skip
            assert box.run("cat /work/private/README").stdout == "v1\n"
            seen = box.run(
                "env; git -C /work/private config --list; cat /work/private/.git/config"
            ).stdout
            assert '[remote "origin"]' in seen  # the control: the config was read
            assert GIT_TOKEN not in seen and basic not in seen
        assert any(r["authorization"] == f"Basic {basic}" for r in outside.git_seen.requests)
    finally:
        tenant.delete("/v1/secrets/GITAUTH")


def test_memory_options_and_labels_through_the_gateway(fleet: Fleet, client: SandboxClient) -> None:
    """preserve_memory_on_stop, include_memory and restore_memory (a memory snapshot booted
    on another node) and labels, with LangSmith's generated client as the SDK sends them."""
    with Langsmith(
        api_key=client._api_key, base_url=fleet.gateway.url, max_retries=0, timeout=SLOW + 30
    ) as api:
        made = api.sandboxes.boxes.create(
            name="keeps", preserve_memory_on_stop=True, mem_bytes=256 * MIB,
            labels={"team": "red"}, extra_body={"timeout": SLOW},
        )  # fmt: skip
        assert made.preserve_memory_on_stop is True and made.labels == {"team": "red"}
        box = client.get_sandbox("keeps")
        box.run(f"echo kept > /opt/note.txt; {KEEPER}")
        box.stop()
        for _ in range(600):
            if client.get_sandbox_status("keeps").status == "stopped":
                break
            time.sleep(0.2)
        box.start(timeout=SLOW)
        assert box.run(f"cat /opt/note.txt; {ALIVE}").stdout == "kept\nalive\n"
        snap = api.sandboxes.boxes.create_snapshot(
            "keeps", body_name="with-memory", include_memory=True
        )
        assert (snap.memory_snapshot_size_bytes or 0) > 0
        elsewhere = another_node(fleet, box.id)
        resumed = api.sandboxes.boxes.create(
            name="resumed", snapshot="with-memory", restore_memory=True,
            extra_headers={NODE_HINT: elsewhere}, extra_body={"timeout": SLOW},
        )  # fmt: skip
        assert resumed.status == "ready"
        moved = client.get_sandbox("resumed")
        assert fleet.node_of(moved.id) == elsewhere
        assert moved.run(f"cat /opt/note.txt; {ALIVE}").stdout == "kept\nalive\n"
        client.delete_sandbox("resumed")
        client.delete_sandbox("keeps")
        client.delete_snapshot(snap.id)


def call(box: Any, method: str, path: str) -> dict[str, Any]:
    """A request from inside the guest to cella's API host, with a key of its own that the
    proxy must not pass on."""
    done = box.run(f"python3 /tmp/call.py {method} {path}", timeout=120)
    assert done.exit_code == 0, done.stderr
    answer: dict[str, Any] = json.loads(done.stdout)
    return answer


def test_access_delegation_reaches_the_gateway(
    fleet: Fleet, client: SandboxClient, tenant: httpx2.Client
) -> None:
    """A delegated box's `http://cella.api` is the gateway, as the box's creator: it sees
    what only the gateway holds (the tenant's registries) and the boxes of every node, until
    the creator's key is revoked."""
    made = fleet.admin.post("/v1/keys", json={"tenant": "acme"}).json()
    creator = SandboxClient(
        api_endpoint=f"{fleet.gateway.url}/api/v2/sandboxes", api_key=made["key"]
    )
    tenant.post("/v1/registries", json={"name": "seen-from-inside", "url": "r.example"})
    try:
        # an admin key acting for the tenant is refused, as on a node; nothing is made
        acting = fleet.admin.post(
            "/api/v2/sandboxes/boxes",
            json={"name": "acted", "access_delegation": {"mode": "INHERIT"}},
            headers={"x-cella-tenant": "acme", "x-api-key": fleet.gateway.admin_key},
        )
        assert acting.status_code == 422 and "own API key" in acting.text, acting.text
        # one through cella's own API, reading only
        with Client(fleet.gateway.url, made["key"]) as own:
            reader = own.create(
                name="reader",
                memory_mib=256,
                access_delegation={"mode": "explicit", "permissions": ["sandboxes:read"]},
            )
        box = creator.create_sandbox(
            name="delegated",
            access_delegation={"mode": "INHERIT"},  # type: ignore[arg-type]
            mem_bytes=256 * MIB,
            timeout=SLOW,
            headers={NODE_HINT: another_node(fleet, reader.id)},
        )
        assert fleet.node_of(box.id) != fleet.node_of(reader.id)
        box.write("/tmp/call.py", CALL)
        assert box.run("echo $LANGSMITH_ENDPOINT").stdout == "http://cella.api\n"
        got = call(box, "GET", "/v1/registries")
        assert got["status"] == 200, got
        assert [r["name"] for r in json.loads(got["body"])["registries"]] == ["seen-from-inside"]
        listed = call(box, "GET", "/api/v2/sandboxes/boxes")
        assert listed["status"] == 200, listed
        names = {b["name"] for b in json.loads(listed["body"])["sandboxes"]}
        assert {"reader", "delegated"} <= names  # both nodes' boxes
        # the reader reads through the gateway, and writes nothing
        inside = creator.get_sandbox("reader")
        inside.write("/tmp/call.py", CALL)
        assert call(inside, "GET", "/v1/registries")["status"] == 200
        wrote = call(inside, "DELETE", "/v1/registries/seen-from-inside")
        assert wrote["status"] == 403, wrote
        assert tenant.get("/v1/registries/seen-from-inside").status_code == 200  # still there
        # revoking the creator's key ends it (the control above: the same calls answered)
        assert fleet.admin.delete(f"/v1/keys/{made['id']}").status_code == 204
        refused = call(client.get_sandbox("delegated"), "GET", "/v1/registries")
        assert refused["status"] == 401 and "revoked" in refused["body"], refused
    finally:
        creator.close()
        tenant.delete("/v1/registries/seen-from-inside")


CALL = """
import json, sys, urllib.request, urllib.error
method, path = sys.argv[1], sys.argv[2]
req = urllib.request.Request("http://cella.api" + path, method=method,
                             headers={"X-Api-Key": "mine", "Authorization": "Bearer mine"})
try:
    with urllib.request.urlopen(req, timeout=60) as r:
        print(json.dumps({"status": r.status, "body": r.read().decode()}))
except urllib.error.HTTPError as e:
    print(json.dumps({"status": e.code, "body": e.read().decode()}))
"""


SERVE = ("mkdir -p /tmp/www && echo served-on-{node} > /tmp/www/page.txt && cd /tmp/www && "
         "(nohup python3 -m http.server 8000 >/dev/null 2>&1 &)")  # fmt: skip
FETCH = ("for i in $(seq 50); do curl -s -o /tmp/got -w '%{{http_code}}' http://{host}/page.txt "
         "> /tmp/code; grep -q '^[1-4]' /tmp/code && break; sleep 0.2; done; "
         "echo \"$(cat /tmp/code) $(cat /tmp/got)\"")  # fmt: skip


def shell(client: httpx2.Client, sandbox_id: str, command: str) -> str:
    answer = client.post(f"/v1/sandboxes/{sandbox_id}/exec", json={"command": command})
    assert answer.status_code == 200, answer.text
    assert answer.json()["exit_code"] == 0, answer.json()
    return str(answer.json()["stdout"])


def test_a_rewrite_reaches_a_sandbox_on_another_node(fleet: Fleet) -> None:
    """A rewrite rule's target runs on another node than the caller: the gateway settles
    it, and checks on every request that the rule's setter may still exec in it (a share
    taken back refuses the next request, in the caller and in a fork of it that inherited
    the rule); a closed port is a 502."""
    keys = {
        who: fleet.admin.post(
            "/v1/keys", json={"tenant": "acme", "principal": who, "roles": ["member"]}
        ).json()["key"]
        for who in ("rw-alice", "rw-bob")
    }
    with fleet.client(keys["rw-alice"]) as alice, fleet.client(keys["rw-bob"]) as bob:
        made = alice.post("/v1/sandboxes", json={**SHAPE_256, "name": "rw-target"})
        assert made.status_code == 201, made.text
        target = made.json()["id"]
        there = fleet.node_of(target)
        elsewhere = next(n for n in NODES if n != there)
        made = bob.post("/v1/sandboxes", json={**SHAPE_256, "name": "rw-caller"},
                        headers={NODE_HINT: elsewhere})  # fmt: skip
        assert made.status_code == 201, made.text
        caller = made.json()["id"]
        fork = None
        try:
            assert fleet.node_of(caller) == elsewhere
            shell(alice, target, SERVE.format(node=there))
            rules = {"rewrites": [
                {"host": "svc.internal", "to": {"sandbox": "rw-target", "port": 8000}},
                {"host": "closed.internal", "to": {"sandbox": target, "port": 8999}},
            ]}  # fmt: skip
            # alice's sandbox is private: bob may not name it...
            refused = bob.put(f"/v1/sandboxes/{caller}/network", json=rules)
            assert refused.status_code == 400 and "may exec in" in refused.text, refused.text
            # ...until she shares it with him (the control: the same rules)
            shared = alice.put(f"/v1/sandboxes/{target}/access",
                               json={"shares": {"rw-bob": "exec"}})  # fmt: skip
            assert shared.status_code == 200, shared.text
            set_ = bob.put(f"/v1/sandboxes/{caller}/network", json=rules)
            assert set_.status_code == 200, set_.text
            kept = set_.json()["network"]["rewrites"]
            assert [r["to"]["sandbox"] for r in kept] == [target, target]  # settled to its id
            got = shell(bob, caller, FETCH.format(host="svc.internal"))
            assert got == f"200 served-on-{there}\n", got
            # a fork made through the gateway inherits the rules, bob as their setter
            forked = bob.post(f"/v1/sandboxes/{caller}/fork", json={"count": 1})
            assert forked.status_code == 201, forked.text
            fork = forked.json()["sandboxes"][0]["id"]
            got = shell(bob, fork, FETCH.format(host="svc.internal"))
            assert got == f"200 served-on-{there}\n", got
            closed = shell(bob, caller, "curl -s -o /dev/null -w '%{http_code}' "
                           "http://closed.internal/")  # fmt: skip
            assert closed == "502", closed
            # the share taken back: the next request is refused, the rule unchanged
            alice.put(f"/v1/sandboxes/{target}/access", json={"shares": {}})
            for box in (caller, fork):
                gone = shell(bob, box, FETCH.format(host="svc.internal"))
                assert gone.startswith("403") and "no longer exec" in gone, gone
                assert "served-on" not in gone
        finally:
            if fork is not None:
                bob.delete(f"/v1/sandboxes/{fork}")
            bob.delete(f"/v1/sandboxes/{caller}")
            alice.delete(f"/v1/sandboxes/{target}")


SHAPE_256 = {"memory_mib": 256}


def test_an_aws_rule_through_the_gateway(
    fleet: Fleet, client: SandboxClient, tenant: httpx2.Client, outside: Outside
) -> None:
    """LangSmith's `aws_auth` through the gateway (a workspace secret the gateway keeps and
    pushes to the nodes, an opaque one): the node's proxy signs with SigV4 and moto, which
    checks every signature, takes the object; the guest holds neither key. The control: a
    box allowed the same host without the rule is refused by S3."""
    key_id, secret = outside.aws_key["AccessKeyId"], outside.aws_key["SecretAccessKey"]
    put = tenant.put("/v1/secrets/FLEET_AWS_ID", json={"value": key_id, "hosts": [S3_HOST]})
    assert put.status_code == 200, put.text
    allow = {"allow_list": [S3_HOST]}
    rule = aws_auth(access_key_id=workspace_secret("FLEET_AWS_ID"),
                    secret_access_key=opaque_secret(secret),
                    env_vars={"AWS_DEFAULT_REGION": "us-east-1"})  # fmt: skip
    url = f"https://{S3_HOST}/{BUCKET}/through-the-gateway.txt"
    code = "curl -sS -o /tmp/out -w '%{http_code}'"
    try:
        config = proxy_config(rules=[rule], access_control=allow)
        with client.sandbox(name="aws-box", proxy_config=config, mem_bytes=256 * MIB,
                            timeout=SLOW) as box:  # fmt: skip
            typed = "-H 'Content-Type: text/plain' --data-binary @/tmp/body"
            sent = box.run(f"printf 'via the gateway' > /tmp/body && {code} -X PUT {typed} '{url}'")
            assert sent.stdout == "200", sent.stdout + sent.stderr
            assert box.run(f"curl -sS '{url}'").stdout == "via the gateway"
            seen = box.run("env; cat /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n'")
            assert "AWS_DEFAULT_REGION=us-east-1" in seen.stdout  # the control: env was read
            assert secret not in seen.stdout and key_id not in seen.stdout
        got = outside.s3.get_object(Bucket=BUCKET, Key="through-the-gateway.txt")
        assert got["Body"].read() == b"via the gateway"
        bare = {"access_control": allow}
        with client.sandbox(name="aws-bare", proxy_config=bare, mem_bytes=256 * MIB,
                            timeout=SLOW) as box:  # fmt: skip
            refused = box.run(f"{code} '{url}'")
            assert refused.stdout == "403", refused.stdout + refused.stderr
    finally:
        tenant.delete("/v1/secrets/FLEET_AWS_ID")


def test_capture_a_docker_image_through_the_gateway(
    fleet: Fleet, client: SandboxClient, tenant: httpx2.Client
) -> None:
    """`capture_snapshot(docker_image=...)` through the gateway: an image made in a docker
    sandbox's own Docker becomes a snapshot of the fleet, which a box boots from on another
    node; a missing image fails the build (the control). The docker box is small: the
    build boots a VM of its own beside it on the box's node (768 MiB here)."""
    made = tenant.post("/v1/sandboxes", json={"template": "docker", "name": "fleet-docker",
                                              "memory_mib": 256})  # fmt: skip
    assert made.status_code == 201, made.text
    box = made.json()["id"]
    try:
        out = tenant.post(f"/v1/sandboxes/{box}/exec", json={"user": "root", "command": (
            "mkdir -p /var/tmp/r/etc && echo made in docker > /var/tmp/r/etc/marker && "
            "tar -C /var/tmp/r -c . | docker import - fleetimg:1")})  # fmt: skip
        assert out.status_code == 200 and out.json()["exit_code"] == 0, out.text
        with pytest.raises(ResourceCreationError, match=r"docker save"):
            client.capture_snapshot("fleet-docker", "nothing", docker_image="absent:1",
                                    timeout=WAIT)  # fmt: skip
        snap = client.capture_snapshot(
            "fleet-docker", "fleet-from-docker", docker_image="fleetimg:1", timeout=WAIT
        )
        assert snap.status == "ready"
        assert [s.id for s in client.list_snapshots(name_contains="fleet-from-docker")] == [snap.id]
        tenant.delete(f"/v1/sandboxes/{box}")  # room for the box made from it
        elsewhere = next(n for n in NODES if not fleet.snapshot_dir(n, snap.id).exists())
        with client.sandbox(snapshot="fleet-from-docker", timeout=SLOW,
                            headers={NODE_HINT: elsewhere}) as sb:  # fmt: skip
            assert sb.read("/etc/marker") == b"made in docker\n"
        client.delete_snapshot(snap.id)
    finally:
        tenant.delete(f"/v1/sandboxes/{box}")


def test_access_delegation_through_a_gateway_serving_tls(fleet: Fleet) -> None:
    """The gateway restarted serving TLS (the last check: every other client here speaks
    plain HTTP to it): a delegated box's `http://cella.api` reaches it over TLS, the node's
    proxy trusting the gateway's certificate alone; revoking the creator's key ends it."""
    # beside the gateway's data, not in this check's tmp_path: it serves with it to the end
    cert, key = node_certificate(fleet.gateway.data_dir / "tls", "127.0.0.1", "gateway")
    fleet.serve_tls(cert, key)
    assert fleet.gateway.url.startswith("https://")
    made = fleet.admin.post("/v1/keys", json={"tenant": "acme"}).json()
    with fleet.client(made["key"]) as creator:
        answer = creator.post("/v1/sandboxes", json={**SHAPE_256, "name": "tls-delegated",
                              "access_delegation": {"mode": "inherit"}})  # fmt: skip
        assert answer.status_code == 201, answer.text
        box = answer.json()["id"]
        write = creator.put(f"/v1/sandboxes/{box}/files/content",
                            params={"path": "/tmp/call.py"}, content=CALL.encode())  # fmt: skip
        assert write.status_code == 200, write.text
        listed = json.loads(shell(creator, box, "python3 /tmp/call.py GET /v1/sandboxes"))
        assert listed["status"] == 200, listed
        assert box in listed["body"]  # the gateway's list, through the node's pinned TLS
        # the control: the creator's key revoked, the same call is refused
        assert fleet.admin.delete(f"/v1/keys/{made['id']}").status_code == 204
        with fleet.client(fleet.gateway.admin_key) as admin:
            acting = {"x-cella-tenant": "acme"}
            again = {"command": "python3 /tmp/call.py GET /v1/sandboxes"}
            out = admin.post(f"/v1/sandboxes/{box}/exec", headers=acting, json=again)
            assert out.status_code == 200, out.text
            refused = json.loads(out.json()["stdout"])
            assert refused["status"] == 401 and "revoked" in refused["body"], refused
            admin.delete(f"/v1/sandboxes/{box}", headers=acting)
