"""A client of several gateways: a request goes on to the next gateway when one does not
answer, if that is safe; real HTTP servers on loopback (one answering, one that resets
every connection after reading the request) and a port nothing listens on."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx2
import pytest

from cella.sdk import AsyncClient, Client


class Seen(BaseHTTPRequestHandler):
    requests: list[tuple[str, str, str]]  # method, path, Host header

    def _answer(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        self.rfile.read(length)
        self.requests.append((self.command, self.path, self.headers["host"]))
        body = b'{"sandboxes": []}' if self.path.split("?")[0] == "/v1/sandboxes" else b'{"ok": 1}'
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args: object) -> None:
        pass


class Resets(Seen):
    def _answer(self) -> None:  # read, then close with no answer (a gateway killed mid-call)
        length = int(self.headers.get("content-length") or 0)
        self.rfile.read(length)
        self.requests.append((self.command, self.path, self.headers["host"]))
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")
        self.close_connection = True
        self.connection.close()

    do_GET = do_POST = _answer


def serve(handler: type[Seen]) -> tuple[str, list[tuple[str, str, str]], ThreadingHTTPServer]:
    seen: list[tuple[str, str, str]] = []
    kind = type("H", (handler,), {"requests": seen})
    server = ThreadingHTTPServer(("127.0.0.1", 0), kind)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}", seen, server


@pytest.fixture
def gateways() -> Iterator[tuple[str, str, str, list[tuple[str, str, str]], list[tuple]]]:
    with socket.socket() as s:  # a port nothing listens on: connections are refused
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    live, seen, a = serve(Seen)
    resets, reset_seen, b = serve(Resets)
    yield dead, live, resets, seen, reset_seen
    a.shutdown()
    b.shutdown()


def test_a_refused_gateway_is_passed_over(gateways: tuple) -> None:
    dead, live, _, seen, _ = gateways
    with Client(url=f"{dead},{live}", api_key="k") as client:
        assert client.url == dead and client.urls == [dead, live]
        client.request("GET", "/v1/x")
        client.request("POST", "/v1/y", json={})  # never reached the dead one: safe
    host = live.removeprefix("http://")
    assert seen == [("GET", "/v1/x", host), ("POST", "/v1/y", host)]
    with Client(url=dead, api_key="k") as alone, pytest.raises(httpx2.ConnectError):
        alone.request("GET", "/v1/x")  # control: with one gateway the error is the caller's


def test_a_reset_call_is_repeated_only_when_safe(gateways: tuple) -> None:
    _, live, resets, seen, reset_seen = gateways
    with Client(url=[resets, live], api_key="k") as client:
        client.request("GET", "/v1/a")  # idempotent: repeated on the next
        client_b = Client(url=[resets, live], api_key="k")
        with pytest.raises(httpx2.TransportError):  # may have run: not repeated
            client_b.request("POST", "/v1/exec", json={})
        client_b.request("POST", "/v1/sandboxes", json={}, headers=client_b.keyed(None))
        client_b.close()
    assert [r[1] for r in reset_seen] == ["/v1/a", "/v1/exec", "/v1/sandboxes"]
    assert [r[1] for r in seen] == ["/v1/a", "/v1/sandboxes"]


def test_creates_carry_a_key_with_several_gateways() -> None:
    several = Client(url=["http://127.0.0.1:1", "http://127.0.0.1:2"], api_key="k")
    one = Client(url="http://127.0.0.1:1", api_key="k")
    assert set(several.keyed(None)) == {"Idempotency-Key"}
    assert several.keyed(None) != several.keyed(None)  # one per call
    assert several.keyed("mine") == {"Idempotency-Key": "mine"}
    assert one.keyed(None) == {}  # control: one daemon, as before
    several.close()
    one.close()


async def test_the_async_client_passes_over_too(gateways: tuple) -> None:
    dead, live, _, seen, _ = gateways
    async with AsyncClient(url=[dead, live], api_key="k") as client:
        await client.request("GET", "/v1/z")
    assert [r[1] for r in seen] == ["/v1/z"]


def test_the_cli_takes_several_urls(gateways: tuple) -> None:
    dead, live, _, seen, _ = gateways
    env = {**os.environ, "CELLA_URL": f"{dead},{live}", "CELLA_API_KEY": "k"}
    done = subprocess.run(
        [sys.executable, "-m", "cella.cli", "sandbox", "ls", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert [r[1].split("?")[0] for r in seen] == ["/v1/sandboxes"]
