"""What the nodes of a fleet share through the gateway: volumes (each on its home node),
webhooks (kept by the gateway, on every node) and templates (built once, on one node), with
cella's API and E2B's (collected by `tests/integration/test_fleet.py` only, inside a
loopback-only network namespace)."""

from __future__ import annotations

import json
import textwrap
import time
from collections.abc import Callable
from typing import Any

import httpx2
import pytest

from cella.fleet.relay import NODE_HINT
from cella.fleet.tls import trusting
from cella.policy import webhooks
from tests.fleet.conftest import NODES, SHAPE, Fleet
from tests.fleet.outside import PASSWORD, REGISTRY, USER, Outside
from tests.sdk_env import run_script, sdk_python

HOOKS = "/fleet-hooks"  # the web server (`web.test`) records what it is sent


def wait_for(check: Callable[[], Any], timeout: float = 60, what: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found := check():
            return found
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what or check}")


def on_node(fleet: Fleet, node: str, method: str, path: str, tenant: str = "acme") -> Any:
    """A call straight to a node daemon, with its admin key acting for `tenant`."""
    url = next(n["url"] for n in fleet.admin.get("/v1/fleet").json()["nodes"] if n["name"] == node)
    key = (fleet.node_root / node / "admin.key").read_text().strip()
    return httpx2.request(
        method,
        f"{url}{path}",
        headers={"authorization": f"Bearer {key}", "x-cella-tenant": tenant},
        verify=trusting((fleet.node_root / node / "tls" / "node.crt").read_text()),
    )


def made(answer: httpx2.Response, status: int = 201) -> dict[str, Any]:
    assert answer.status_code == status, answer.text
    return dict(answer.json())


def shell(tenant: httpx2.Client, sandbox_id: str, command: str) -> str:
    done = made(tenant.post(f"/v1/sandboxes/{sandbox_id}/exec", json={"command": command}), 200)
    assert done["exit_code"] == 0, done
    return str(done["stdout"])


def read_until(tenant: httpx2.Client, sandbox_id: str, path: str) -> str:
    """A file another sandbox wrote to a volume, once its upload is done."""

    def read() -> str | None:
        done = tenant.post(f"/v1/sandboxes/{sandbox_id}/exec", json={"command": f"cat {path}"})
        return done.json()["stdout"] if done.json()["exit_code"] == 0 else None

    return str(wait_for(read, 30, f"{path} in {sandbox_id}"))


def home_of(fleet: Fleet, volume_id: str) -> str:
    held = [n for n in NODES if (fleet.node_root / n / "volumes" / volume_id).is_dir()]
    assert len(held) == 1, held
    return held[0]


def test_a_volume_written_on_one_node_is_read_on_another(
    fleet: Fleet, tenant: httpx2.Client
) -> None:
    """A volume made at the gateway lives on one node, its home: its content API goes
    there, a sandbox that mounts it is placed there unless another node is asked for, and
    a sandbox on another node mounts it too (its node sends the mount's requests on to the
    home), so what one writes the other reads; a sandbox without volumes goes where it is
    asked (the control), a volume the tenant does not have is refused by name."""
    vol = made(tenant.post("/v1/volumes", json={"name": "fleet-vol"}))
    home = home_of(fleet, vol["id"])
    elsewhere = next(n for n in NODES if n != home)
    try:
        again = tenant.post("/v1/volumes", json={"name": "fleet-vol"})
        assert again.status_code == 409, again.text  # one name in the tenant, fleet-wide
        wrote = tenant.put(
            "/v1/volumes/fleet-vol/content", params={"path": "/from-api.txt"}, content=b"api\n"
        )
        assert wrote.status_code == 200, wrote.text
        a = made(tenant.post("/v1/sandboxes", json={
            **SHAPE, "volume_mounts": [{"volume": "fleet-vol", "path": "/mnt/v"}]}))  # fmt: skip
        assert fleet.node_of(str(a["id"])) == home
        assert shell(tenant, a["id"], "cat /mnt/v/from-api.txt") == "api\n"
        shell(tenant, a["id"], "echo from-a > /mnt/v/from-a.txt")
        b = made(tenant.post(
            "/v1/sandboxes",
            json={**SHAPE, "volume_mounts": [{"volume": vol["id"], "path": "/data"}]},
            headers={NODE_HINT: elsewhere},
        ))  # fmt: skip
        assert fleet.node_of(str(b["id"])) == elsewhere  # where it was asked: the volume lent
        assert read_until(tenant, b["id"], "/data/from-a.txt") == "from-a\n"
        shell(tenant, b["id"], "echo from-b > /data/from-b.txt")
        assert read_until(tenant, a["id"], "/mnt/v/from-b.txt") == "from-b\n"
        got = tenant.get("/v1/volumes/fleet-vol/content", params={"path": "/from-b.txt"})
        assert got.status_code == 200 and got.content == b"from-b\n"  # on the home, as kept
        assert (fleet.node_root / home / "volumes" / vol["id"] / "from-b.txt").exists()
        assert not (fleet.node_root / elsewhere / "volumes" / vol["id"]).exists()
        listed = tenant.get("/v1/volumes").json()
        assert [v["name"] for v in listed["volumes"]] == ["fleet-vol"]
        # the controls: a sandbox without volumes goes where it is asked; a volume no node
        # has is refused by name, and another tenant sees none of this one
        c = made(tenant.post("/v1/sandboxes", json=SHAPE, headers={NODE_HINT: elsewhere}))
        assert fleet.node_of(str(c["id"])) == elsewhere
        nothing = tenant.post("/v1/sandboxes", json={
            **SHAPE, "volume_mounts": [{"volume": "no-such-vol", "path": "/x"}]})  # fmt: skip
        assert nothing.status_code == 400 and "no-such-vol" in nothing.text, nothing.text
        key = fleet.admin.post("/v1/keys", json={"tenant": "globex"}).json()["key"]
        with fleet.client(key) as theirs:
            assert theirs.get("/v1/volumes/fleet-vol").status_code == 404
            assert theirs.get("/v1/volumes").json()["volumes"] == []
        # the lending is the gateway's alone: a tenant's key cannot lend itself a volume
        lend = {"tenant": "acme", "name": "x", "url": "https://127.0.0.1:1", "token": "t"}
        refused = tenant.put(f"/v1/volumes/{vol['id']}/remote", json=lend)
        assert refused.status_code == 403, refused.text
        in_use = tenant.delete("/v1/volumes/fleet-vol")
        assert in_use.status_code == 409, in_use.text  # mounted: refused on its node
    finally:
        for sb in tenant.get("/v1/sandboxes").json()["sandboxes"]:
            tenant.delete(f"/v1/sandboxes/{sb['id']}")
    assert tenant.delete("/v1/volumes/fleet-vol").status_code == 204
    assert tenant.get(f"/v1/volumes/{vol['id']}").status_code == 404
    assert not (fleet.node_root / home / "volumes" / vol["id"]).exists()


def test_e2b_volumes_through_the_gateway(fleet: Fleet, tenant: httpx2.Client) -> None:
    """E2B's SDK makes, writes and reads a volume at the gateway (its content API reached
    with the volume's own token, on the volume's node); a wrong token is refused there."""
    python = sdk_python("e2b-2.63.0", ["e2b==2.63.0"])
    key = tenant.headers["authorization"].split()[1]
    script = """
        import json
        from e2b import Volume
        from e2b.exceptions import VolumeNotFoundException
        vol = Volume.create("e2b-fleet-vol")
        vol.write_file("/hello.txt", "through the gateway")
        read = vol.read_file("/hello.txt")
        listed = [v.name for v in Volume.list()]
        try:
            Volume.get_info("vol-0000000000000000")
            unknown = "found"
        except VolumeNotFoundException as exc:
            unknown = type(exc).__name__
        info = Volume.get_info("e2b-fleet-vol")
        print(json.dumps({"id": vol.volume_id, "read": read, "listed": listed,
                          "unknown": unknown, "name": info.name}))
    """
    env = {"E2B_API_URL": fleet.gateway.url, "E2B_VOLUME_API_URL": fleet.gateway.url,
           "E2B_API_KEY": key}  # fmt: skip
    got = run_script(python, textwrap.dedent(script), env)
    assert got["read"] == "through the gateway" and got["name"] == "e2b-fleet-vol"
    assert "e2b-fleet-vol" in got["listed"] and got["unknown"] == "VolumeNotFoundException"
    home = home_of(fleet, got["id"])
    assert (fleet.node_root / home / "volumes" / got["id"] / "hello.txt").read_text() == (
        "through the gateway"
    )
    content = f"/volumecontent/{got['id']}/file"
    wrong = httpx2.get(
        f"{fleet.gateway.url}{content}",
        params={"path": "/hello.txt"},
        headers={"authorization": "Bearer not-its-token"},
    )
    assert wrong.status_code == 401, wrong.text
    api = {"x-api-key": key}
    shown = httpx2.get(f"{fleet.gateway.url}/volumes/{got['id']}", headers=api).json()
    right = httpx2.get(
        f"{fleet.gateway.url}{content}",
        params={"path": "/hello.txt"},
        headers={"authorization": f"Bearer {shown['token']}"},
    )
    assert right.status_code == 200 and right.content == b"through the gateway"  # the control
    gone = httpx2.delete(f"{fleet.gateway.url}/volumes/{got['id']}", headers=api)
    assert gone.status_code == 204, gone.text
    assert httpx2.get(f"{fleet.gateway.url}/volumes/{got['id']}", headers=api).status_code == 404


def test_a_webhook_at_the_gateway_hears_every_node(
    fleet: Fleet, tenant: httpx2.Client, outside: Outside
) -> None:
    """A webhook registered at the gateway is on every node with one id and secret, so a
    sandbox's create and kill on the last node reach it signed with that secret; a URL
    outside the nodes' boundary is refused and left nowhere (the control: the same
    registration by a name the operator's table holds works)."""
    refused = tenant.post("/v1/webhooks", json={"url": "http://127.0.0.1/hooks"})
    assert refused.status_code == 400, refused.text
    assert tenant.get("/v1/webhooks").json()["webhooks"] == []
    assert all(on_node(fleet, n, "GET", "/v1/webhooks").json()["webhooks"] == [] for n in NODES)
    events = ["sandbox.created", "sandbox.killed"]
    url = f"http://web.test{HOOKS}"
    hook = made(tenant.post("/v1/webhooks", json={"url": url, "events": events}))
    key = tenant.headers["authorization"].split()[1]
    e2b_hook = made(httpx2.post(f"{fleet.gateway.url}/events/webhooks", headers={"x-api-key": key},
                                json={"url": f"http://web.test{HOOKS}/e2b",
                                      "events": ["sandbox.lifecycle.killed"],
                                      "signatureSecret": "e2b-secret-of-the-fleet"}))  # fmt: skip
    try:
        for node in NODES:
            held = on_node(fleet, node, "GET", "/v1/webhooks").json()["webhooks"]
            assert sorted(h["id"] for h in held) == sorted([hook["id"], e2b_hook["id"]])
        last = NODES[-1]
        sb = made(tenant.post("/v1/sandboxes", json=SHAPE, headers={NODE_HINT: last}))
        assert fleet.node_of(str(sb["id"])) == last
        assert tenant.delete(f"/v1/sandboxes/{sb['id']}").status_code == 204

        def heard(path: str) -> list[dict[str, Any]]:
            return [
                r for r in outside.seen.requests
                if r["path"] == path and sb["id"] in r["body"]
            ]  # fmt: skip

        ours = wait_for(lambda: len(heard(HOOKS)) >= 2 and heard(HOOKS), what="both events")
        theirs = wait_for(lambda: heard(f"{HOOKS}/e2b"), what="E2B's event")
    finally:
        tenant.delete(f"/v1/webhooks/{hook['id']}")
        httpx2.delete(f"{fleet.gateway.url}/events/webhooks/{e2b_hook['id']}",
                      headers={"x-api-key": key})  # fmt: skip
    assert [json.loads(r["body"])["type"] for r in ours] == ["sandbox.created", "sandbox.killed"]
    for request in ours:
        h = request["headers"]
        assert h["cella-webhook-id"] == hook["id"]
        assert webhooks.verify(hook["secret"], request["body"].encode(), h["cella-timestamp"],
                               h["cella-signature"])  # fmt: skip
        assert not webhooks.verify("whsec_another", request["body"].encode(),
                                   h["cella-timestamp"], h["cella-signature"])  # fmt: skip
    [e2b_event] = theirs
    assert json.loads(e2b_event["body"])["type"] == "sandbox.lifecycle.killed"
    assert e2b_event["headers"]["e2b-signature"] == webhooks.e2b_signature(
        "e2b-secret-of-the-fleet", e2b_event["body"].encode()
    )
    # deleted at the gateway: gone from every node, and deleted only once
    assert all(on_node(fleet, n, "GET", "/v1/webhooks").json()["webhooks"] == [] for n in NODES)
    assert tenant.delete(f"/v1/webhooks/{hook['id']}").status_code == 404


def build(fleet: Fleet, body: dict[str, Any]) -> list[dict[str, Any]]:
    answer = fleet.admin.post("/v1/templates", json=body, timeout=600)
    assert answer.status_code == 200, answer.text
    return [json.loads(line) for line in answer.text.splitlines() if line.strip()]


def test_a_template_built_through_the_gateway_boots_on_every_node(
    fleet: Fleet, tenant: httpx2.Client, outside: Outside
) -> None:
    """An image template built at the gateway is built on one node (its progress names it;
    the nodes here share one image cache, so every node holds it after), and its sandboxes
    boot wherever they are asked for; a build that cannot pull
    (no credentials) fails and leaves the template nowhere (the control)."""
    # by its address: a template's image is fetched on the host, not through the proxy
    image = outside.image.replace(REGISTRY, outside.registry.addr)
    nologin = build(fleet, {"name": "fleet-nologin", "image": image})
    assert nologin[-1]["type"] == "error", nologin[-1]
    assert fleet.admin.get("/v1/templates/fleet-nologin").status_code == 404
    login = {"value": f"{USER}:{PASSWORD}", "hosts": [outside.registry.addr]}
    assert fleet.admin.put("/v1/secrets/fleet-registry", json=login).status_code == 200
    try:
        events = build(fleet, {"name": "fleet-bb", "image": image,
                               "registry_secret": "fleet-registry"})  # fmt: skip
        assert events[-1]["type"] == "done", events[-1]
        progress = " ".join(e["message"] for e in events if e["type"] == "progress")
        assert sum(f"[{n}]" in progress for n in NODES) == 1, progress  # built once
        shown = made(fleet.admin.get("/v1/templates/fleet-bb"), 200)
        assert shown["built"] and sorted(shown["nodes"]) == sorted(NODES)
        for node in (NODES[0], NODES[-1]):
            sb = made(tenant.post("/v1/sandboxes", json={**SHAPE, "template": "fleet-bb"},
                                  headers={NODE_HINT: node}))  # fmt: skip
            assert fleet.node_of(str(sb["id"])) == node
            assert "from the upper layer" in shell(tenant, sb["id"], "cat /app/hello.txt")
            tenant.delete(f"/v1/sandboxes/{sb['id']}")
        gone = fleet.admin.delete("/v1/templates/fleet-bb")
        assert gone.status_code == 204, gone.text
        for node in NODES:
            assert on_node(fleet, node, "GET", "/v1/templates/fleet-bb").status_code == 404
        never = tenant.post("/v1/sandboxes", json={**SHAPE, "template": "fleet-bb"})
        assert never.status_code >= 400 and "fleet-bb" in never.text, never.text
    finally:
        fleet.admin.delete("/v1/secrets/fleet-registry")


def test_e2b_named_templates_live_on_their_node(fleet: Fleet, tenant: httpx2.Client) -> None:
    """E2B's build API at the gateway (the calls its `Template` builder makes, up to the
    build itself): a named template is made on one node, and its upload link, details,
    list and removal reach it there; another tenant does not see it (the control)."""
    key = tenant.headers["authorization"].split()[1]
    api = httpx2.Client(base_url=fleet.gateway.url, headers={"x-api-key": key})
    asked = made(api.post("/v3/templates", json={"name": "fleet-named", "tags": ["v1"]}), 202)
    template_id = asked["templateID"]
    path = f"/templates/{template_id}"
    holders = [n for n in NODES if on_node_e2b(fleet, n, path).status_code == 200]
    assert len(holders) == 1, holders
    again = made(api.post("/v3/templates", json={"name": "fleet-named"}), 202)
    assert again["templateID"] == template_id  # the same template: its home again
    files = "ab" * 32
    link = made(api.get(f"/templates/{template_id}/files/{files}"), 201)
    assert link["present"] is False and link["url"].startswith(fleet.gateway.url), link
    uploaded = httpx2.put(link["url"], content=b"not much of an archive")
    assert uploaded.status_code == 200, uploaded.text
    assert made(api.get(f"/templates/{template_id}/files/{files}"), 201)["present"] is True
    forged = httpx2.put(link["url"].replace(files, "cd" * 32), content=b"x")
    assert forged.status_code in (401, 403), forged.text  # the link is for its files only
    shown = made(api.get(f"/templates/{template_id}"), 200)
    assert shown["templateID"] == template_id
    assert made(api.get("/templates/aliases/fleet-named"), 200)["templateID"] == template_id
    assert api.get("/templates").json() == []  # listed once a build of it is ready
    other = fleet.admin.post("/v1/keys", json={"tenant": "hooli"}).json()["key"]
    theirs = httpx2.get(f"{fleet.gateway.url}/templates/{template_id}",
                        headers={"x-api-key": other})  # fmt: skip
    assert theirs.status_code == 404, theirs.text
    assert api.delete(f"/templates/{template_id}").status_code == 204
    assert api.get(f"/templates/{template_id}").status_code == 404
    api.close()


def on_node_e2b(fleet: Fleet, node: str, path: str, tenant: str = "acme") -> httpx2.Response:
    """An E2B call straight to a node daemon, its admin key acting for `tenant`."""
    url = next(n["url"] for n in fleet.admin.get("/v1/fleet").json()["nodes"] if n["name"] == node)
    key = (fleet.node_root / node / "admin.key").read_text().strip()
    return httpx2.get(
        f"{url}{path}",
        headers={"x-api-key": key, "x-cella-tenant": tenant},
        verify=trusting((fleet.node_root / node / "tls" / "node.crt").read_text()),
    )


@pytest.fixture(autouse=True)
def no_sandboxes_left(tenant: httpx2.Client) -> Any:
    yield
    for sb in tenant.get("/v1/sandboxes").json()["sandboxes"]:
        tenant.delete(f"/v1/sandboxes/{sb['id']}")
