"""E2B's API on the fleet gateway (`cella.fleet.e2b`, `e2b_envd`), with node doubles that
record what they are asked: envd's traffic goes to the node of the sandbox it names (by
header or host name) with the caller's envd credentials and no key of the gateway's; lists
are merged from every node's pages and paged again; errors are E2B's shape. (The real
thing, E2B's SDK on a Ray cluster: `tests/fleet/e2b_checks.py`.)"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import httpx2
import pytest

from cella.config import DaemonSettings
from cella.fleet.app import create_gateway_app
from cella.fleet.node_client import Node

SANDBOX = "sb-0123456789abcdef"
Answer = Callable[[httpx2.Request], httpx2.Response]


@dataclass
class Gateway:
    client: httpx2.AsyncClient
    asked: dict[str, list[httpx2.Request]]
    key: str
    domain: str


def node(name: str, answer: Answer, asked: list[httpx2.Request]) -> Node:
    def recorded(request: httpx2.Request) -> httpx2.Response:
        asked.append(request)
        return answer(request)

    made = Node(name, f"id-{name}", "http://127.0.0.1:9", f"{name}-admin-key")
    made.client = httpx2.AsyncClient(base_url=made.url, transport=httpx2.MockTransport(recorded))
    return made


def listing(request: httpx2.Request, items: list[list[dict[str, str]]]) -> httpx2.Response:
    """A node's E2B list in pages of its own (its token: the index of the next page)."""
    token = request.url.params.get("nextToken")
    at = int(base64.urlsafe_b64decode(token)) if token else 0
    more = {"x-next-token": base64.urlsafe_b64encode(b"%d" % (at + 1)).decode()}
    return httpx2.Response(200, json=items[at], headers=more if at + 1 < len(items) else {})


N1 = [[{"sandboxID": "sb-1", "startedAt": "2026-01-01T00:00:01Z"}]]
N2 = [
    [{"sandboxID": "sb-2", "startedAt": "2026-01-01T00:00:00Z"}],
    [{"sandboxID": "sb-3", "startedAt": "2026-01-01T00:00:02Z"}],
]


def answers(pages: list[list[dict[str, str]]]) -> Answer:
    def answer(request: httpx2.Request) -> httpx2.Response:
        if request.url.path in ("/sandboxes", "/v2/sandboxes"):
            return listing(request, pages)
        if request.url.path.startswith("/v1/secrets/"):  # a secret pushed to the node
            return httpx2.Response(200, json={})
        if request.url.path.startswith("/v1/sandboxes/"):  # the gateway looking for one
            return httpx2.Response(404, json={"error": {"code": "not_found", "message": "no"}})
        return httpx2.Response(200, stream=httpx2.ByteStream(b"from the node"))

    return answer


@pytest.fixture
async def gateway(tmp_path: Path) -> AsyncIterator[Gateway]:
    """The gateway's app (no Ray: its lifespan does not run) with two node doubles; the
    sandbox is on n2, as the admin's tenant's."""
    settings = DaemonSettings(data_dir=tmp_path / "gw")
    app = create_gateway_app(settings, "ray://unused")
    gw = app.state.daemon
    asked: dict[str, list[httpx2.Request]] = {"n1": [], "n2": []}
    for name, pages in (("n1", N1), ("n2", N2)):
        gw.membership.nodes[name] = node(name, answers(pages), asked[name])
    key = (tmp_path / "gw" / "admin.key").read_text().strip()
    tenant = gw.keys.authenticate(key).tenant
    gw.placements.put("n2", {"id": SANDBOX, "tenant": tenant})
    transport = httpx2.ASGITransport(app=app)
    async with httpx2.AsyncClient(transport=transport, base_url="http://gateway") as client:
        yield Gateway(client, asked, key, settings.ports_domain)


async def test_envd_goes_to_the_sandboxs_node_with_its_own_credentials(gateway: Gateway) -> None:
    sent = {
        "e2b-sandbox-id": SANDBOX,
        "x-access-token": "envd-token",
        "authorization": "Basic dXNlcjo=",  # envd's user, the SDK's to name
        "x-api-key": gateway.key,  # not the node's business
    }
    got = await gateway.client.post("/process.Process/Start", headers=sent, content=b"{}")
    assert got.status_code == 200 and got.text == "from the node"
    assert not gateway.asked["n1"]
    (request,) = gateway.asked["n2"]
    assert request.url.path == "/process.Process/Start"
    assert request.headers["x-access-token"] == "envd-token"
    assert request.headers["e2b-sandbox-id"] == SANDBOX
    assert request.headers["authorization"] == "Basic dXNlcjo="
    assert "x-api-key" not in request.headers  # neither the caller's key nor the node's


async def test_envd_by_host_name_of_its_own_ports_only(gateway: Gateway) -> None:
    host = {"host": f"49983-{SANDBOX}.{gateway.domain}", "x-access-token": "t"}
    got = await gateway.client.get("/files", params={"path": "/etc/hostname"}, headers=host)
    assert got.status_code == 200
    (request,) = gateway.asked["n2"]
    assert request.headers["e2b-sandbox-id"] == SANDBOX and request.url.path == "/files"
    # another port's host name is not envd: the gateway's own routes answer it
    other = {"host": f"3000-{SANDBOX}.{gateway.domain}"}
    assert (await gateway.client.get("/v1/health", headers=other)).json()["fleet"] is True
    assert len(gateway.asked["n2"]) == 1


async def test_envd_of_an_unknown_sandbox_is_not_running(gateway: Gateway) -> None:
    unknown = {"e2b-sandbox-id": "sb-ffffffffffffffff", "x-access-token": "t"}
    plain = await gateway.client.get("/health", headers=unknown)
    assert plain.status_code == 502
    assert plain.json() == {"code": 502, "message": "The sandbox sb-ffffffffffffffff was not found"}
    rpc = await gateway.client.post("/filesystem.Filesystem/Stat", headers=unknown, json={})
    assert rpc.status_code == 502 and "not found" in rpc.json()["message"]
    assert not gateway.asked["n1"] and not gateway.asked["n2"]


async def test_lists_are_merged_from_every_nodes_pages(gateway: Gateway) -> None:
    key = {"x-api-key": gateway.key}
    first = await gateway.client.get("/sandboxes", params={"limit": 2, "x": "y"}, headers=key)
    assert first.status_code == 200, first.text
    assert [s["sandboxID"] for s in first.json()] == ["sb-2", "sb-1"]  # by start, both nodes
    token = first.headers["x-next-token"]
    rest = await gateway.client.get(
        "/v2/sandboxes", params={"limit": 2, "nextToken": token}, headers=key
    )
    assert [s["sandboxID"] for s in rest.json()] == ["sb-3"] and "x-next-token" not in rest.headers
    descending = await gateway.client.get("/sandboxes", params={"order": "desc"}, headers=key)
    assert [s["sandboxID"] for s in descending.json()] == ["sb-3", "sb-1", "sb-2"]
    # each node was asked for its pages with the caller's filters, as the caller's tenant
    asked = gateway.asked["n2"][0]
    assert asked.url.params["x"] == "y" and asked.headers["x-api-key"] == "n2-admin-key"


async def test_e2b_errors_are_e2bs_shape(gateway: Gateway) -> None:
    nokey = await gateway.client.get(f"/sandboxes/{SANDBOX}")
    assert nokey.status_code == 401 and set(nokey.json()) == {"code", "message"}
    missing = await gateway.client.post(
        "/sandboxes/sb-ffffffffffffffff/connect", headers={"x-api-key": gateway.key}, json={}
    )
    assert missing.status_code == 404
    assert missing.json() == {"code": 404, "message": "sandbox sb-ffffffffffffffff not found"}
    bad = await gateway.client.post(
        f"/sandboxes/{SANDBOX}/fork", headers={"x-api-key": gateway.key}, json={"count": 0}
    )
    assert bad.status_code == 400 and "count" in bad.json()["message"]
    assert {r.url.path for r in gateway.asked["n1"]} == {"/v1/sandboxes/sb-ffffffffffffffff"}
    relayed = await gateway.client.post(
        f"/sandboxes/{SANDBOX}/timeout", headers={"x-api-key": gateway.key}, json={"timeout": 9}
    )
    assert relayed.status_code == 200 and relayed.text == "from the node"
    assert json.loads(gateway.asked["n2"][-1].content) == {"timeout": 9}


async def test_e2b_secrets_are_the_fleets_kept_on_every_node(gateway: Gateway) -> None:
    key = {"x-api-key": gateway.key}
    body = {"name": "Api_Token", "value": "s3cret", "metadata": {"team": "red"}}
    made = await gateway.client.post("/secrets", headers=key, json=body)
    assert made.status_code == 201, made.text
    assert made.json()["secretID"] == "sec_api_token" and made.json()["metadata"] == {"team": "red"}
    for name in ("n1", "n2"):  # on every node, the value and metadata with it
        (pushed,) = [r for r in gateway.asked[name] if r.url.path.startswith("/v1/secrets/")]
        assert pushed.method == "PUT" and pushed.url.path == "/v1/secrets/api_token"
        assert json.loads(pushed.content)["metadata"] == {"team": "red"}
        assert json.loads(pushed.content)["value"] == "s3cret"
    again = await gateway.client.post("/secrets", headers=key, json=body)
    assert again.status_code == 409 and set(again.json()) == {"code", "message"}
    newer = await gateway.client.post("/secrets/sec_api_token", headers=key, json={"value": "v2"})
    assert newer.json()["currentVersion"] == 2 and newer.json()["metadata"] == {"team": "red"}
    listed = (await gateway.client.get("/secrets", headers=key)).json()
    assert [s["name"] for s in listed] == ["api_token"]
    assert "s3cret" not in json.dumps(listed) and "v2" not in json.dumps(listed)
    assert (await gateway.client.delete("/secrets/api_token", headers=key)).status_code == 204
    assert [r.method for r in gateway.asked["n2"] if "secrets" in r.url.path][-1] == "DELETE"
    gone = await gateway.client.get("/secrets/api_token", headers=key)
    assert gone.status_code == 404
    bad = await gateway.client.post("/secrets", headers=key, json={"name": "sec_x", "value": "v"})
    assert bad.status_code == 400 and "reserved" in bad.json()["message"]
