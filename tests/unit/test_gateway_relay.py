"""The fleet gateway's relay of service URLs (`cella.fleet.app`), with a node double that
records what it is asked: the service token is the only credential (the gateway lends the
node's admin key to no one without a key of their own), and a path is relayed only as the
route the gateway matched (dot segments, which the HTTP client would resolve into another
route, are refused)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx2
import pytest

from cella.config import DaemonSettings
from cella.fleet.app import create_gateway_app
from cella.fleet.node_client import Node

SANDBOX = "sb-0123456789abcdef"


@pytest.fixture
async def gateway(tmp_path: Path) -> AsyncIterator[tuple[httpx2.AsyncClient, list[httpx2.Request]]]:
    """The gateway's app (no Ray: its lifespan does not run) with one node, a double that
    answers 200 to anything and keeps the requests."""
    app = create_gateway_app(DaemonSettings(data_dir=tmp_path / "gw"), "ray://unused")
    asked: list[httpx2.Request] = []

    def answer(request: httpx2.Request) -> httpx2.Response:
        asked.append(request)
        return httpx2.Response(200, stream=httpx2.ByteStream(b"from the node"))

    node = Node("n1", "node-1", "http://127.0.0.1:9", "node-admin-key")
    node.client = httpx2.AsyncClient(base_url=node.url, transport=httpx2.MockTransport(answer))
    app.state.daemon.membership.nodes[node.name] = node
    app.state.daemon.placements.put(node.name, {"id": SANDBOX, "tenant": "t1"})
    transport = httpx2.ASGITransport(app=app)
    async with httpx2.AsyncClient(transport=transport, base_url="http://gateway") as client:
        yield client, asked


async def test_a_service_url_is_relayed_with_its_token_only(
    gateway: tuple[httpx2.AsyncClient, list[httpx2.Request]],
) -> None:
    client, asked = gateway
    got = await client.get(
        f"/v1/services/{SANDBOX}/8000/index.html", headers={"x-cella-service-token": "tok"}
    )
    assert got.status_code == 200 and got.text == "from the node"  # the control: relayed
    (sent,) = asked
    assert sent.url.path == f"/v1/services/{SANDBOX}/8000/index.html"
    assert sent.headers["x-cella-service-token"] == "tok"
    assert "authorization" not in sent.headers  # not the node's admin key


@pytest.mark.parametrize(
    "sneaky",
    [
        f"/v1/services/{SANDBOX}/8000/%2e%2e/%2e%2e/%2e%2e/keys",
        f"/v1/services/{SANDBOX}/%2E%2E/%2e%2e/sandboxes",
        f"/v1/services/{SANDBOX}/8000/.%2e/..%2F..%2F..%2Fkeys",
        f"/v1/services/{SANDBOX}/8000/%2e/x",
    ],
)
async def test_a_path_that_would_name_another_route_is_refused(
    gateway: tuple[httpx2.AsyncClient, list[httpx2.Request]], sneaky: str
) -> None:
    client, asked = gateway
    got = await client.post(sneaky, json={"tenant": "t1"})
    assert got.status_code == 400 and got.json()["error"]["code"] == "invalid_argument"
    assert not asked  # nothing reached the node


async def test_a_download_link_is_relayed_with_its_token_only(
    gateway: tuple[httpx2.AsyncClient, list[httpx2.Request]],
) -> None:
    client, asked = gateway
    got = await client.get(f"/v1/downloads/{SANDBOX}/root/out.csv?token=tok")
    assert got.status_code == 200 and got.text == "from the node"
    (sent,) = asked
    assert sent.url.path == f"/v1/downloads/{SANDBOX}/root/out.csv"
    assert sent.url.params["token"] == "tok" and "authorization" not in sent.headers
    missing = await client.get("/v1/downloads/sb-unknown/root/out.csv?token=tok")
    assert missing.status_code == 404 and len(asked) == 1


async def test_a_login_url_names_the_gateways_caller_to_the_node(
    gateway: tuple[httpx2.AsyncClient, list[httpx2.Request]],
) -> None:
    client, asked = gateway
    keys = client._transport.app.state.daemon.keys  # type: ignore[attr-defined]
    key_id, key = keys.create("t1")
    path = f"/v1/logins/{SANDBOX}/8010/who"
    assert (await client.get(path)).status_code == 401  # no key: nothing relayed
    assert not asked
    # the caller's claim to be someone else is dropped; the gateway says who it is
    got = await client.get(path, headers={"x-api-key": key, "x-cella-user": "key-mallory"})
    assert got.status_code == 200
    (sent,) = asked
    assert sent.headers["x-cella-user"] == key_id
    assert sent.headers["x-cella-tenant"] == "t1"
    assert sent.headers["authorization"] == "Bearer node-admin-key"
    assert "x-api-key" not in sent.headers
    _, stranger = keys.create("t2")
    refused = await client.get(path, headers={"authorization": f"Bearer {stranger}"})
    assert refused.status_code == 404 and len(asked) == 1


async def test_the_fleets_jwks_is_every_nodes_keys(tmp_path: Path) -> None:
    app = create_gateway_app(DaemonSettings(data_dir=tmp_path / "gw"), "ray://unused")
    served = {
        "n1": [{"kty": "OKP", "crv": "Ed25519", "x": "AAAA", "kid": "k1"}],
        "n2": [
            {"kty": "OKP", "crv": "Ed25519", "x": "BBBB", "kid": "k2"},
            {"kty": "OKP", "crv": "Ed25519", "x": "AAAA", "kid": "k1"},
        ],
    }
    for name, keys in served.items():

        def answer(request: httpx2.Request, keys: list[dict[str, str]] = keys) -> httpx2.Response:
            assert request.url.path == "/.well-known/jwks.json"
            return httpx2.Response(200, json={"keys": keys})

        node = Node(name, f"node-{name}", "http://127.0.0.1:9", "node-admin-key")
        node.client = httpx2.AsyncClient(base_url=node.url, transport=httpx2.MockTransport(answer))
        app.state.daemon.membership.nodes[name] = node
    down = Node("n3", "node-n3", "http://127.0.0.1:9", "k", healthy=False)
    app.state.daemon.membership.nodes["n3"] = down  # not asked: it is not up
    transport = httpx2.ASGITransport(app=app)
    async with httpx2.AsyncClient(transport=transport, base_url="http://gateway") as client:
        got = await client.get("/.well-known/jwks.json")  # no key needed
    assert got.status_code == 200
    assert sorted(k["kid"] for k in got.json()["keys"]) == ["k1", "k2"]
