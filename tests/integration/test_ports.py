"""Servers inside a sandbox, reached from the host: service URLs (HTTP, a browser's cookie,
WebSockets), host names and `cella sandbox port-forward`, against real servers in a real
microVM; what a guest's answer may set in a browser, and who reaches the interpreter port."""

from __future__ import annotations

import http.client
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from urllib.parse import urlencode

import httpx2
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from cella import Client, Sandbox
from tests.daemon import Daemon, free_port

pytestmark = pytest.mark.vm

# an HTTP server that serves files, echoes POST bodies, tells the path it was asked for
# and answers `/set...?c=<cookie>&h=<name: value>` with those headers; the same on 49999
# (where a code interpreter would listen); a WebSocket echo server; stdlib only
SERVERS = r"""
import base64, hashlib, http.server, socketserver, struct, sys, threading, urllib.parse

class Echo(http.server.SimpleHTTPRequestHandler):
    def end_headers(self):
        self.send_header("X-Seen-Path", self.path)
        super().end_headers()

    def do_GET(self):
        if not self.path.startswith("/set"):
            return super().do_GET()
        asked = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
        self.send_response(200)
        for cookie in asked.get("c", []):
            self.send_header("Set-Cookie", cookie)
        for header in asked.get("h", []):
            self.send_header(*header.split(": ", 1))
        self.send_header("Content-Length", "3")
        self.end_headers()
        self.wfile.write(b"set")

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(201)
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
interpreter = http.server.ThreadingHTTPServer(("127.0.0.1", 49999), Echo)
threading.Thread(target=interpreter.serve_forever, daemon=True).start()
http.server.ThreadingHTTPServer(("127.0.0.1", 8000), Echo).serve_forever()
"""
SERVED_PORTS = (8000, 8001, 49999)
HELLO = "hello from the guest\n"


def start_servers(sb: Sandbox) -> None:
    """An HTTP echo server on 8000 and 49999 and a WebSocket echo on 8001 in the guest,
    answering."""
    sb.files.write("/srv/servers.py", SERVERS, parents=True)
    sb.files.write("/srv/hello.txt", HELLO)
    sb.exec("cd /srv && nohup python3 servers.py >/tmp/servers.log 2>&1 &")
    ready = f"import socket; [socket.create_connection(('127.0.0.1', p)) for p in {SERVED_PORTS}]"
    for _ in range(100):
        if sb.exec(["python3", "-c", ready]).exit_code == 0:
            return
        time.sleep(0.2)
    raise AssertionError(
        "the guest's servers never listened: " + sb.exec("cat /tmp/servers.log").stdout.decode()
    )


@pytest.fixture(scope="module")
def served(admin: Client) -> Iterator[Sandbox]:
    sb = admin.create()
    start_servers(sb)
    yield sb
    sb.delete()


@pytest.fixture(scope="module")
def public(admin: Client, daemon: Daemon) -> Iterator[Sandbox]:
    """A sandbox whose ports answer anyone by host name (`network.public_ports`)."""
    made = httpx2.post(
        f"{daemon.url}/v1/sandboxes",
        json={"network": {"public_ports": True}},
        headers={"authorization": f"Bearer {daemon.admin_key}"},
        timeout=120,
    )
    assert made.status_code == 201, made.text
    sb = admin.get(made.json()["id"])
    start_servers(sb)
    yield sb
    sb.delete()


def test_a_service_url_reaches_a_guest_server_with_its_token_only(served: Sandbox) -> None:
    exposed = served.expose(8000, expires_in_seconds=60)
    token = {"X-Cella-Service-Token": exposed.token}
    got = httpx2.get(f"{exposed.url}/hello.txt", headers=token)
    assert got.status_code == 200 and got.text == HELLO
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
    with pytest.raises(InvalidStatus) as refused, connect(url) as ws:  # no token: no upgrade
        ws.recv()
    assert refused.value.response.status_code == 403


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


def e2b_tokens(daemon: Daemon, sb: Sandbox) -> tuple[str, str]:
    """The sandbox's access token and traffic token, as E2B's control plane hands them out
    (its `connect`, which E2B's SDK calls)."""
    answer = httpx2.post(
        f"{daemon.url}/sandboxes/{sb.id}/connect", headers={"X-API-KEY": daemon.admin_key}
    )
    assert answer.status_code == 200, answer.text
    return answer.json()["envdAccessToken"], answer.json()["trafficAccessToken"]


def routes(daemon: Daemon, sb: Sandbox, token: str) -> dict[str, tuple[str, dict[str, str]]]:
    """The ways to the guest's port 8000 (base URL, headers): a service URL and the host
    path, both on the daemon's host, and the port's host name, an origin of its own."""
    auth = {"X-Cella-Service-Token": token}
    return {
        "service": (f"{daemon.url}/v1/services/{sb.id}/8000", auth),
        "host path": (f"{daemon.url}/v1/hosts/{sb.id}/8000", auth),
        "host name": (daemon.url, {**auth, "host": f"8000-{sb.id}.localhost:{daemon.port}"}),
    }


def set_by_guest(
    base: str,
    headers: dict[str, str],
    cookies: tuple[str, ...] = (),
    more: tuple[str, ...] = (),
) -> httpx2.Response:
    """The guest's answer to `/set/deep`, carrying these cookies and headers."""
    query = urlencode([("c", c) for c in cookies] + [("h", h) for h in more])
    answer = httpx2.get(f"{base}/set/deep?{query}", headers=headers)
    assert answer.status_code == 200 and answer.text == "set", answer.text
    return answer


def test_guest_pages_on_the_daemons_host_are_sandboxed(served: Sandbox, daemon: Daemon) -> None:
    """On both path forms a guest's page gets the sandboxing CSP (no `allow-same-origin`:
    an opaque origin, not the console's); by its host name it has an origin of its own."""
    token = served.expose(8000).token
    for route, (base, headers) in routes(daemon, served, token).items():
        page = httpx2.get(f"{base}/hello.txt", headers=headers)
        assert page.status_code == 200 and page.text == HELLO, route  # the control: served
        policies = page.headers.get_list("content-security-policy")
        sandboxed = any(
            p.split()[0] == "sandbox" and "allow-same-origin" not in p for p in policies
        )
        assert sandboxed == (route != "host name"), (route, policies)


def test_guest_cookies_stay_inside_their_port(served: Sandbox, daemon: Daemon) -> None:
    """A guest's `Set-Cookie`, each alone: on the daemon's host, never one of the daemon's
    names, a nameless one or one with a `Domain`, and the rest kept inside the port's path;
    by host name, only a `Domain` beyond the guest's own host is dropped. The ordinary
    cookies are the control: they reach the browser on every route."""
    own_host = f"8000-{served.id}.localhost"
    service, by_path = (f"{prefix}/{served.id}/8000" for prefix in ("/v1/services", "/v1/hosts"))
    # the cookie: what arrives by service URL, by the host path, by host name (None: dropped)
    expected = {
        "cella_session=planted; Path=/": (None, None, "cella_session=planted; Path=/"),
        f"cella_service_{served.id}_8000=x": (None, None, f"cella_service_{served.id}_8000=x"),
        "=cella_session=planted": (None, None, None),
        "wide=1; Path=/; Domain=127.0.0.1": (None, None, None),
        "parent=1; Domain=localhost": (None, None, None),
        f"own=1; Domain={own_host}": (None, None, f"own=1; Domain={own_host}"),
        "app=1; Path=/; HttpOnly": (
            f"app=1; HttpOnly; Path={service}/",
            f"app=1; HttpOnly; Path={by_path}/",
            "app=1; Path=/; HttpOnly",
        ),
        "here=1": (f"here=1; Path={service}/set", f"here=1; Path={by_path}/set", "here=1"),
    }
    token = served.expose(8000).token
    for cookie, arrives in expected.items():
        for (route, (base, headers)), wanted in zip(
            routes(daemon, served, token).items(), arrives, strict=True
        ):
            got = set_by_guest(base, headers, (cookie,)).headers.get_list("set-cookie")
            assert got == ([wanted] if wanted else []), (cookie, route)


ORIGIN_WIDE = [
    'Clear-Site-Data: "cookies", "storage"',
    "Strict-Transport-Security: max-age=0",
    "Alt-Svc: clear",
    'NEL: {"report_to": "g", "max_age": 86400}',
    'Report-To: {"group": "g", "max_age": 86400, "endpoints": [{"url": "http://127.0.0.1:9/"}]}',
    'Reporting-Endpoints: g="http://127.0.0.1:9/"',
    "Service-Worker-Allowed: /",
]


def test_guest_headers_that_act_on_the_daemons_origin_are_dropped(
    served: Sandbox, daemon: Daemon
) -> None:
    """Headers that clear an origin's cookies and storage, turn its HTTPS off, send its
    traffic or its error reports elsewhere: not from a guest on the daemon's host; by host
    name they act on the guest's own origin and pass. `X-App` is the control."""
    token = served.expose(8000).token
    names = {h.split(":")[0].lower() for h in ORIGIN_WIDE}
    for route, (base, headers) in routes(daemon, served, token).items():
        answer = set_by_guest(base, headers, more=(*ORIGIN_WIDE, "X-App: kept"))
        assert answer.headers["x-app"] == "kept", route
        passed = names & set(answer.headers.keys())
        assert passed == (names if route == "host name" else set()), (route, passed)


def test_the_interpreter_port_takes_the_access_token_on_every_route(
    public: Sandbox, daemon: Daemon
) -> None:
    """Port 49999 (the code interpreter: it runs code) of a sandbox whose ports are public:
    by the host path and by host name, nothing without the sandbox's access token; the
    same request with it reaches the server, and the sandbox's other ports need none."""
    access, _ = e2b_tokens(daemon, public)
    by_path = f"{daemon.url}/v1/hosts/{public.id}/49999/execute"
    by_name = {"host": f"49999-{public.id}.localhost:{daemon.port}"}
    for url, headers in ((by_path, {}), (f"{daemon.url}/execute", by_name)):
        assert httpx2.post(url, json={}, headers=headers).status_code == 401, url
        forged = {**headers, "X-Access-Token": access[:-2] + "AA"}
        assert httpx2.post(url, json={}, headers=forged).status_code == 401, url
        ran = httpx2.post(url, json={}, headers={**headers, "X-Access-Token": access})
        assert ran.status_code == 201 and ran.headers["x-seen-path"] == "/execute", url
    other = httpx2.get(f"{daemon.url}/v1/hosts/{public.id}/8000/hello.txt")
    assert other.status_code == 200 and other.text == HELLO  # the control: a public port


def raw_request(
    daemon: Daemon, method: str, path: str, headers: dict[str, str]
) -> tuple[int, str | None]:
    """A request whose path goes out exactly as written (no client normalises it): the
    status, and the path the guest server was asked for."""
    conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=60)
    try:
        body = b"{}" if method == "POST" else None
        conn.request(
            method, path, body=body, headers={"content-type": "application/json", **headers}
        )
        answer = conn.getresponse()
        answer.read()
        return answer.status, answer.getheader("x-seen-path")
    finally:
        conn.close()


def test_the_interpreter_api_at_the_e2b_address_takes_a_token(
    public: Sandbox, served: Sandbox, daemon: Daemon
) -> None:
    """`/contexts` and `/execute` with `E2b-Sandbox-Id` reach port 49999 of a sandbox,
    public or not, only with its tokens: `/contexts` with the traffic token (all E2B's SDK
    sends there) or the access token, `/execute` with the access token. A path that
    resolves to `/execute` is checked as `/execute`."""
    for sb in (public, served):
        access, traffic = e2b_tokens(daemon, sb)
        named = {"E2b-Sandbox-Id": sb.id}
        with_traffic = {**named, "E2B-Traffic-Access-Token": traffic}
        with_access = {**named, "X-Access-Token": access}
        assert raw_request(daemon, "POST", "/contexts", named)[0] == 403
        assert raw_request(daemon, "GET", "/contexts", named)[0] == 403
        assert raw_request(daemon, "POST", "/contexts", with_traffic) == (201, "/contexts")
        assert raw_request(daemon, "POST", "/contexts", with_access) == (201, "/contexts")
        assert raw_request(daemon, "POST", "/execute", with_traffic)[0] == 401
        assert raw_request(daemon, "POST", "/execute", with_access) == (201, "/execute")
        for sneaky in (
            "/contexts/../execute",
            "/contexts/%2e%2e/execute",
            "/contexts/..%2fexecute",
        ):
            assert raw_request(daemon, "POST", sneaky, with_traffic)[0] == 401, sneaky
            assert raw_request(daemon, "POST", sneaky, with_access) == (201, "/execute"), sneaky


def test_the_guest_is_asked_for_the_path_that_was_checked(served: Sandbox, daemon: Daemon) -> None:
    """Dot segments (plain or encoded), doubled and encoded slashes are resolved before the
    request goes to the guest; an encoded `?` stays in the path; a path the daemon's own
    API would answer goes to the guest's server all the same."""
    token = {"X-Cella-Service-Token": served.expose(8000).token}
    base = f"/v1/services/{served.id}/8000"
    for asked, seen in (
        ("/hello.txt", "/hello.txt"),  # the control
        ("/a/../hello.txt", "/hello.txt"),
        ("/a/%2e%2e/hello.txt", "/hello.txt"),
        ("//hello.txt", "/hello.txt"),
        ("/a%2F..%2Fhello.txt", "/hello.txt"),
        ("/../../../v1/keys", "/v1/keys"),
        ("/x%3Fy=1", "/x%3Fy=1"),
        ("/sp%20ace", "/sp%20ace"),
    ):
        assert raw_request(daemon, "GET", base + asked, token)[1] == seen, asked
