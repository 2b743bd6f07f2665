"""Servers inside a sandbox, reached from the host: service URLs (HTTP, a browser's cookie,
WebSockets) and `cella sandbox port-forward`, against real servers in a real microVM."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx2
import pytest
from websockets.sync.client import connect

from cella import Client, Sandbox
from tests.daemon import Daemon, free_port

pytestmark = pytest.mark.vm

# an HTTP server that echoes POST bodies, and a WebSocket echo server, stdlib only
SERVERS = r"""
import base64, hashlib, http.server, socketserver, struct, sys, threading

class Echo(http.server.SimpleHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(201)
        self.send_header("X-Seen-Path", self.path)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

class WsEcho(socketserver.StreamRequestHandler):
    def handle(self):
        head = b""
        while b"\r\n\r\n" not in head:
            head += self.request.recv(1024)
        lines = head.split(b"\r\n")
        wanted = [l for l in lines if l.lower().startswith(b"sec-websocket-key")]
        key = wanted[0].split(b":", 1)[1].strip()
        magic = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
        accept = base64.b64encode(hashlib.sha1(key + magic).digest())
        self.wfile.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                         b"Connection: Upgrade\r\nSec-WebSocket-Accept: " + accept + b"\r\n\r\n")
        while True:
            b1, b2 = self.rfile.read(2)
            n = b2 & 127
            if n == 126: n = struct.unpack(">H", self.rfile.read(2))[0]
            elif n == 127: n = struct.unpack(">Q", self.rfile.read(8))[0]
            mask = self.rfile.read(4)
            data = bytes(c ^ mask[i % 4] for i, c in enumerate(self.rfile.read(n)))
            op = b1 & 15
            if op == 8:
                self.wfile.write(b"\x88\x00"); return
            reply = b"echo:" + data
            n = len(reply)
            size = bytes([n]) if n < 126 else b"\x7e" + struct.pack(">H", n)
            hdr = bytes([0x80 | op]) + size
            self.wfile.write(hdr + reply)

class Threaded(socketserver.ThreadingMixIn, socketserver.TCPServer):
    allow_reuse_address = True
    daemon_threads = True

threading.Thread(target=Threaded(("127.0.0.1", 8001), WsEcho).serve_forever, daemon=True).start()
http.server.ThreadingHTTPServer(("127.0.0.1", 8000), Echo).serve_forever()
"""


def start_servers(sb: Sandbox) -> None:
    """An HTTP echo server on 8000 and a WebSocket echo on 8001 in the guest, answering."""
    sb.files.write("/srv/servers.py", SERVERS, parents=True)
    sb.files.write("/srv/hello.txt", "hello from the guest\n")
    sb.exec("cd /srv && nohup python3 servers.py >/tmp/servers.log 2>&1 &")
    ready = "import socket; [socket.create_connection(('127.0.0.1', p)) for p in (8000, 8001)]"
    for _ in range(100):
        if sb.exec(["python3", "-c", ready]).exit_code == 0:
            break
        time.sleep(0.2)


@pytest.fixture(scope="module")
def served(admin: Client) -> Iterator[Sandbox]:
    sb = admin.create()
    start_servers(sb)
    yield sb
    sb.delete()


def test_a_service_url_reaches_a_guest_server_with_its_token_only(served: Sandbox) -> None:
    exposed = served.expose(8000, expires_in_seconds=60)
    token = {"X-Cella-Service-Token": exposed.token}
    got = httpx2.get(f"{exposed.url}/hello.txt", headers=token)
    assert got.status_code == 200 and got.text == "hello from the guest\n"
    posted = httpx2.post(f"{exposed.url}/api/items?x=1", headers=token, content=b"\x00\xffbody")
    assert posted.status_code == 201 and posted.content == b"\x00\xffbody"
    assert posted.headers["x-seen-path"] == "/api/items?x=1"
    # the LangSmith SDK's header works too
    ls = {"X-Langsmith-Sandbox-Service-Token": exposed.token}
    assert httpx2.get(f"{exposed.url}/hello.txt", headers=ls).status_code == 200
    # refused: no token, a forged one, one for another port
    assert httpx2.get(f"{exposed.url}/hello.txt").status_code == 403
    forged = exposed.token[:-3] + ("AAA" if not exposed.token.endswith("AAA") else "BBB")
    assert (
        httpx2.get(f"{exposed.url}/", headers={"X-Cella-Service-Token": forged}).status_code == 403
    )
    other = served.expose(8001).token
    assert (
        httpx2.get(f"{exposed.url}/", headers={"X-Cella-Service-Token": other}).status_code == 403
    )
    # nothing listening: a clear error, not a hang
    closed = served.expose(8999)
    r = httpx2.get(f"{closed.url}/", headers={"X-Cella-Service-Token": closed.token})
    assert r.status_code == 502 and r.json()["error"]["code"] == "port_closed"


def test_a_browser_logs_in_once_then_uses_a_cookie(served: Sandbox) -> None:
    exposed = served.expose(8000)
    with httpx2.Client() as browser:
        first = browser.get(exposed.browser_url)
        assert first.status_code == 303 and "cella_token" not in first.headers["location"]
        page = browser.get(first.headers["location"])
        assert page.status_code == 200 and "hello.txt" in page.text  # the directory listing
        assert browser.get(f"{exposed.url}/hello.txt").text == "hello from the guest\n"


def test_a_websocket_through_a_service_url(served: Sandbox) -> None:
    exposed = served.expose(8001)
    url = exposed.url.replace("http://", "ws://") + "/chat"
    with connect(url, additional_headers={"X-Cella-Service-Token": exposed.token}) as ws:
        ws.send("hi")
        assert ws.recv() == "echo:hi"
        ws.send(b"\x01\x02")
        assert ws.recv() == b"echo:\x01\x02"
    with pytest.raises(Exception, match=r"403|4403|rejected"), connect(url) as ws:
        ws.recv()


def test_port_forward_from_the_cli(served: Sandbox, daemon: Daemon) -> None:
    local = free_port()
    env = {**os.environ, "CELLA_URL": daemon.url, "CELLA_API_KEY": daemon.admin_key}
    proc = subprocess.Popen(
        [sys.executable, "-m", "cella.cli", "sandbox", "port-forward", served.id, f"{local}:8000"],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        assert "forwarding" in proc.stderr.readline()
        for _ in range(3):  # several connections over the one forward
            assert (
                httpx2.get(f"http://127.0.0.1:{local}/hello.txt").text == "hello from the guest\n"
            )
        big = os.urandom(3 << 20)
        echoed = httpx2.post(f"http://127.0.0.1:{local}/up", content=big, timeout=60)
        assert echoed.content == big
    finally:
        proc.terminate()
        proc.wait(10)
