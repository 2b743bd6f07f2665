"""What a guest can reach, asked from inside it: one probe script a sandbox runs against a
table of targets, and the table of the host's loopback doors (a test server, the daemon's
API, a neighbour's service URL) that a victim must not pass and its control must, through
the operator's doors (a name in `egress_hosts`, an address in `egress_tenant_networks`).
test_egress (a sandbox without rules) and test_hardening (a root guest with the broadest
address rules) run the same matrix."""

from __future__ import annotations

import json
import time

from cella import Sandbox
from cella.models import ExposedPort

# A target: [kind, *arguments]. Kinds: "proxy" (HTTP GET through the explicit egress
# proxy: url, headers), "direct" (HTTP GET with no proxy: the transparent path), "tcp"
# (connect: host, port), "udp" (a DNS query: host, port), "port" (open the agent's
# serial port a second time). A result: "open ..." (an answer under 400, a connection),
# "denied STATUS BODY" (an HTTP answer of 400 or more) or "blocked ERROR" (none at all).
Target = list[object]

EGRESS = "10.0.2.100"  # the guest's egress address: the proxy's port 3128, and 80/443
NO_BYPASS = {"no_proxy": "", "NO_PROXY": ""}  # send loopback names to the proxy too

PROBE = r"""
import glob, json, os, socket, sys, urllib.request, urllib.error
via_proxy = urllib.request.build_opener(
    urllib.request.ProxyHandler({"http": "http://10.0.2.100:3128"}))
direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
def http(opener, url, headers=None):
    try:
        r = opener.open(urllib.request.Request(url, headers=headers or {}), timeout=10)
        return f"open {r.status} {r.read(300).decode(errors='replace')}"
    except urllib.error.HTTPError as e:
        return f"denied {e.code} {e.read(300).decode(errors='replace')}"
def tcp(host, port):
    socket.create_connection((host, port), timeout=3).close()
    return "open"
def udp(host, port):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(1.5)
        query = b"\x12\x34\x01\x00\x00\x01" + bytes(6) + b"\x03web\x04test\x00\x00\x01\x00\x01"
        s.sendto(query, (host, port))
        return f"open {s.recv(512)!r}"
def port():
    ports = glob.glob("/dev/vport*") + glob.glob("/dev/virtio-ports/*")
    if not ports:
        raise FileNotFoundError("no virtio ports visible")
    fd = os.open(ports[0], os.O_RDWR)  # the agent holds it: a second opener gets EBUSY
    os.write(fd, b"\xff" * 64)
    return f"open {ports[0]}"
kinds = {
    "proxy": lambda *a: http(via_proxy, *a),
    "direct": lambda *a: http(direct, *a),
    "tcp": tcp,
    "udp": udp,
    "port": port,
}
out = {}
for name, (kind, *args) in json.loads(sys.argv[1]).items():
    try:
        out[name] = kinds[kind](*args)
    except Exception as e:
        out[name] = f"blocked {type(e).__name__}: {e}"
print(json.dumps(out))
"""


def probe(sb: Sandbox, targets: dict[str, Target]) -> dict[str, str]:
    """Each target tried from inside `sb`, by name."""
    sb.files.write("/tmp/probe.py", PROBE)
    r = sb.exec(["python3", "/tmp/probe.py", json.dumps(targets)], env=NO_BYPASS, timeout=180)
    assert r.exit_code == 0, r.stderr
    result: dict[str, str] = json.loads(r.stdout)
    assert set(result) == set(targets)
    return result


def serve_marker(sb: Sandbox) -> None:
    """`neighbour-marker` on port 8000 of the sandbox's loopback."""
    sb.files.write("/srv/m", "neighbour-marker\n")
    sb.exec("cd /srv && nohup python3 -m http.server 8000 --bind 127.0.0.1 >/dev/null 2>&1 &")
    ready = "import socket; socket.create_connection(('127.0.0.1', 8000), timeout=1)"
    for _ in range(100):
        if sb.exec(["python3", "-c", ready]).exit_code == 0:
            return
        time.sleep(0.2)
    raise AssertionError("the neighbour's server never answered")


def control_rules(web: str, api_port: int) -> list[str]:
    """Rules that open exactly the doors below, through the operator's: `web.test` and
    `api.test` are names in its host table, `web` lies in a network it lets tenants open."""
    return ["web.test", f"{web}/32:80", f"api.test:{api_port}"]


def doors(web: str, api_port: int, neighbour: ExposedPort) -> dict[str, tuple[Target, Target]]:
    """Ways to the host's loopback through the proxy: for each, the victim's probe and the
    control's probe of the same server. `web` is a test server's loopback address (named
    `web.test`), `api_port` the daemon's port on 127.0.0.1 (named `api.test`), `neighbour`
    another sandbox's server on its service URL."""
    api = f"http://api.test:{api_port}/v1/health"
    token = {"X-Cella-Service-Token": neighbour.token}
    by_name = neighbour.url.replace("127.0.0.1", "api.test")
    return {
        "a name no rule allows": (["proxy", "http://web.test/reach"],) * 2,
        "a loopback test server by address": (["proxy", f"http://{web}/reach"],) * 2,
        "the daemon API": (["proxy", f"http://127.0.0.1:{api_port}/v1/health"], ["proxy", api]),
        "the daemon API as IPv4-mapped IPv6": (
            ["proxy", f"http://[::ffff:127.0.0.1]:{api_port}/v1/health"],
            ["proxy", api],
        ),
        "the neighbour's server by its service URL": (
            ["proxy", f"{neighbour.url}/m", token],
            ["proxy", f"{by_name}/m", token],
        ),
    }
