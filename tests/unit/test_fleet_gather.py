"""A read the gateway gathers from every node (`Membership.each`) is not held by a node that
hangs: it fails within `GATHER_TIMEOUT`, naming the node; a write keeps the long timeout. The
nodes are loopback servers: one answers, one accepts connections and never replies."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx2
import pytest

from cella import errors
from cella.fleet import membership as membership_module
from cella.fleet.membership import Membership
from cella.fleet.node_client import Node


class _Answers(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = json.dumps({"snapshots": []}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: Any) -> None:
        pass


@pytest.fixture
def answering() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Answers)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture
def hanging() -> Iterator[str]:
    """Accepts connections and reads requests, never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(listener.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    listener.close()
    for conn in held:
        conn.close()


def fleet(*urls: str) -> Membership:
    members = Membership("", False, "", None, None)  # type: ignore[arg-type]
    members.nodes = {f"n{i}": Node(f"n{i}", f"id{i}", url, "key") for i, url in enumerate(urls)}
    return members


async def test_a_hung_node_fails_a_gathered_read_quickly_and_by_name(
    answering: str, hanging: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(membership_module, "GATHER_TIMEOUT", httpx2.Timeout(5.0, read=0.5))
    # the control: nodes that answer give their answers
    answers = await fleet(answering, answering).each("GET", "/v1/snapshots", None)
    assert [a for _, a in answers] == [{"snapshots": []}, {"snapshots": []}]
    began = time.monotonic()
    with pytest.raises(errors.NodeUnavailable, match="node n1 does not answer"):
        await fleet(answering, hanging).each("GET", "/v1/snapshots", None)
    assert time.monotonic() - began < 5  # the read's bound, not the node client's 10 minutes


async def test_a_gathered_write_keeps_the_long_timeout(
    hanging: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, Any] = {}

    async def json_call(self: Node, method: str, path: str, who: Any, **kw: Any) -> Any:
        seen.update(kw)
        return {}

    monkeypatch.setattr(Node, "json", json_call)
    await fleet(hanging).each("PUT", "/v1/secrets/x", None, json={})
    assert "timeout" not in seen  # the node client's own (long operations may be slow)
    await fleet(hanging).each("GET", "/v1/secrets", None)
    assert seen["timeout"] is membership_module.GATHER_TIMEOUT
