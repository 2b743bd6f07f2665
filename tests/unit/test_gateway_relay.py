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
