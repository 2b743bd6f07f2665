"""E2B's lifecycle and network items with its official SDK (`e2b==2.63.0`, pinned,
unchanged) against a real daemon: auto-pause and auto-resume (traffic to envd or a port
wakes a paused sandbox and waits for it), lifetimes that paused time does not spend,
filesystem-only pauses, fork counts, `maskRequestHost`, `denyOut` on top of `allowOut`,
a bring-your-own upstream proxy (SOCKS5 from E2B, HTTP CONNECT from cella's SDK) that
records what passed through it, and workload identity tokens a verifier checks against
the daemon's JWKS. Every refusal has a control that succeeds the same way."""

from __future__ import annotations

import json
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2
import jwt
import pytest

from cella import Client
from cella.models import HeaderRule, IdentityToken
from cella.models import UpstreamProxy as UpstreamProxyRule
from tests.daemon import Daemon
from tests.netservers import EchoHandler, Recorder, Servers, UpstreamProxy, free_loopback_block
from tests.sdk_env import run_script, sdk_python

pytestmark = pytest.mark.vm
E2B = ["e2b==2.63.0"]
AUDIENCE = "https://api.e2b.test"


@pytest.fixture(scope="module")
def python() -> Path:
    return sdk_python("e2b-2.63.0", E2B)


@dataclass
class Net:
    """Servers on loopback reached from sandboxes by names of the operator's host table:
    `api.e2b.test` and `other.e2b.test` echo what they are sent; `proxy.e2b.test` is a
    SOCKS5 proxy (user `alice`), `proxy-http.e2b.test` an HTTP CONNECT one, both recording
    each tunnel they carry."""

    api: str
    api_seen: Recorder
    other_seen: Recorder
    socks: UpstreamProxy
    connect: UpstreamProxy


@pytest.fixture(scope="module")
def net() -> Iterator[Net]:
    block = free_loopback_block()
    servers = Servers()
    api_seen = servers.start(EchoHandler, (f"{block}.1", 80))
    other_seen = servers.start(EchoHandler, (f"{block}.2", 80))
    socks = UpstreamProxy((f"{block}.3", 1080), "socks5", credentials=("alice", "s0cks-pw"))
    connect = UpstreamProxy((f"{block}.4", 3128), "http")
    yield Net(f"{block}.1", api_seen, other_seen, socks, connect)
    socks.close()
    connect.close()
    servers.close()


@pytest.fixture(scope="module")
def daemon_settings(net: Net) -> dict[str, str]:
    hosts = {
        "api.e2b.test": net.api,
        "other.e2b.test": net.api.rpartition(".")[0] + ".2",
        "proxy.e2b.test": net.socks.address[0],
        "proxy-http.e2b.test": net.connect.address[0],
    }
    return {
        "pool_size": "1",
        "max_sandboxes_per_tenant": "10",
        "reaper_interval": "0.5",
        "egress_hosts": json.dumps(hosts),
        "egress_tenant_upstreams": json.dumps({"corp": "http://proxy-http.e2b.test:3128"}),
    }


def e2b(python: Path, daemon: Daemon, script: str) -> Any:
    env = {
        "E2B_API_URL": daemon.url,
        "E2B_SANDBOX_URL": daemon.url,
        "E2B_API_KEY": daemon.admin_key,
    }
    preamble = textwrap.dedent(
        """
        import json, os, time, urllib.request, urllib.error
        from datetime import datetime, timezone
        from e2b import *
        BASE = os.environ["E2B_API_URL"]
        def fetch(host, path="/", **headers):
            req = urllib.request.Request(BASE + path, headers={"Host": host, **headers})
            try:
                with urllib.request.urlopen(req, timeout=120) as r:
                    return [r.status, r.read().decode()]
            except urllib.error.HTTPError as e:
                return [e.code, e.read().decode()]
        def left(sb):
            return (sb.get_info().end_at - datetime.now(timezone.utc)).total_seconds()
        def wait_state(sb, state, seconds=120):
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                if sb.get_info().state.value == state:
                    return True
                time.sleep(0.25)
            return False
        HOST_SERVER = '''
        import http.server, sys
        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                body = ("host=" + self.headers.get("Host", "")).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
        http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
        '''
        def serve(sb, port=8000):
            import textwrap as tw
            sb.files.write("/home/user/host.py", tw.dedent(HOST_SERVER))
            sb.commands.run(f"python3 /home/user/host.py {port}", background=True)
            sb.commands.run(f"for i in $(seq 300); do curl -sf localhost:{port} >/dev/null "
                            "&& break; sleep 0.1; done")
            return sb
        """
    )
    return run_script(python, preamble + textwrap.dedent(script), env)


def test_auto_pause_then_traffic_resumes(python: Path, daemon: Daemon) -> None:
    """A sandbox made with `on_timeout: pause` and `auto_resume` is paused by its timeout;
    a request to its port wakes it and is answered (it waited), and so does a command (envd)
    after an explicit pause. The control: a paused sandbox without auto-resume stays
    paused, and the same request and command fail."""
    got = e2b(
        python,
        daemon,
        """
        sb = serve(Sandbox.create(timeout=120, lifecycle={"on_timeout": "pause",
                                                          "auto_resume": True}))
        out = {"lifecycle": [sb.get_info().lifecycle["on_timeout"],
                             sb.get_info().lifecycle["auto_resume"]]}
        sb.set_timeout(3)  # its server is up: now let the timeout pause it
        out["auto_paused"] = wait_state(sb, "paused")
        out["port"] = fetch(sb.get_host(8000))  # waits while it wakes
        out["after_port"] = sb.get_info().state.value
        out["left"] = left(sb)  # a wake after the timeout ran out: 300 s at least
        out["paused"] = sb.pause()
        out["run"] = sb.commands.run("echo awake").stdout  # envd wakes it too
        out["after_run"] = sb.get_info().state.value
        plain = serve(Sandbox.create(timeout=120))
        plain.pause()
        try:
            plain.commands.run("echo no")
            out["plain_run"] = "ran"
        except Exception as e:
            out["plain_run"] = type(e).__name__
        out["plain_port"] = fetch(plain.get_host(8000))[0]
        out["plain_state"] = plain.get_info().state.value
        sb.kill(); plain.kill()
        print(json.dumps(out))
        """,
    )
    assert got["lifecycle"] == ["pause", True]
    assert got["auto_paused"] is True
    assert got["port"][0] == 200 and got["port"][1].startswith("host=")
    assert got["after_port"] == "running" and got["left"] >= 250
    assert got["paused"] is True and got["run"] == "awake\n" and got["after_run"] == "running"
    assert got["plain_run"] != "ran" and got["plain_port"] >= 400
    assert got["plain_state"] == "paused"


def test_paused_time_is_not_spent(python: Path, daemon: Daemon, admin: Client) -> None:
    """An E2B sandbox paused for a while has, when traffic wakes it, the time it had left
    when it was paused; the control, a sandbox on cella's wall clock, loses those seconds."""
    got = e2b(
        python,
        daemon,
        """
        sb = Sandbox.create(timeout=300, lifecycle={"on_timeout": "pause", "auto_resume": True})
        before = left(sb)
        sb.pause()
        time.sleep(12)
        sb.commands.run("true")  # woken by envd traffic, its lifetime not run out
        print(json.dumps({"id": sb.sandbox_id, "before": before, "after": left(sb)}))
        """,
    )
    assert got["after"] >= got["before"] - 6, got  # (12 s paused, not spent)
    e2b_usage = admin.get(got["id"]).usage().ttl_remaining_seconds
    assert e2b_usage is not None and e2b_usage >= got["before"] - 10
    wall = admin.create(ttl_seconds=300)
    try:
        before = wall.usage().ttl_remaining_seconds
        wall.pause()
        time.sleep(12)
        wall.resume()
        after = wall.usage().ttl_remaining_seconds
        assert before is not None and after is not None and after <= before - 12
    finally:
        wall.delete()
        admin.get(got["id"]).delete()


def test_filesystem_pause_and_fork_counts(python: Path, daemon: Daemon) -> None:
    """`pause(mode="filesystem")` keeps the files and not the processes; a fork asks for
    1-100 sandboxes (E2B's spec; its SDK stops at 20): 101 is a 400 in E2B's shape, the
    same call with 2 makes two."""
    got = e2b(
        python,
        daemon,
        """
        from e2b.api import ApiClient
        from e2b.connection_config import ConnectionConfig
        from e2b.api.client.api.sandboxes import post_sandboxes_sandbox_id_fork
        from e2b.api.client.models import SandboxForkRequest
        sb = Sandbox.create()
        sb.files.write("/home/user/kept.txt", "kept")
        sb.commands.run("sleep 900", background=True)
        api = ApiClient(ConnectionConfig())
        def fork(count):
            r = post_sandboxes_sandbox_id_fork.sync_detailed(
                sb.sandbox_id, client=api, body=SandboxForkRequest(count=count))
            return [r.status_code, json.loads(r.content)]
        out = {"too_many": fork(101), "two": fork(2)}
        for made in out["two"][1]:
            Sandbox.kill(made["sandbox"]["sandboxID"])
        out["paused"] = sb.pause(mode="filesystem")
        out["state"] = sb.get_info().state.value
        back = Sandbox.connect(sb.sandbox_id)
        out["file"] = back.files.read("/home/user/kept.txt")
        try:
            back.commands.run("pgrep -x sleep")
            out["sleep"] = "running"
        except CommandExitException:
            out["sleep"] = "gone"
        back.kill()
        print(json.dumps(out))
        """,
    )
    status, body = got["too_many"]
    assert status == 400 and body["code"] == 400 and "1-100" in body["message"]
    assert got["two"][0] == 201 and len(got["two"][1]) == 2
    assert got["paused"] is True and got["state"] == "paused"
    assert got["file"] == "kept" and got["sleep"] == "gone"


def test_mask_request_host(python: Path, daemon: Daemon) -> None:
    """`maskRequestHost` is the Host the sandbox's port server sees; the control, a
    sandbox without it, sees its own loopback address."""
    got = e2b(
        python,
        daemon,
        """
        masked = serve(Sandbox.create(network={"mask_request_host": "${PORT}-app.example.com"}))
        plain = serve(Sandbox.create())
        out = {"masked": fetch(masked.get_host(8000)), "plain": fetch(plain.get_host(8000)),
               "info": masked.get_info().network.get("mask_request_host")}
        masked.kill(); plain.kill()
        print(json.dumps(out))
        """,
    )
    assert got["masked"] == [200, "host=8000-app.example.com"]
    assert got["info"] == "${PORT}-app.example.com"
    assert got["plain"] == [200, "host=127.0.0.1:8000"]


def test_deny_out_and_an_upstream_proxy(
    python: Path, daemon: Daemon, admin: Client, net: Net
) -> None:
    """`denyOut` refuses a name `allowOut` covers; `egressProxy` sends what is allowed
    through the tenant's SOCKS5 proxy (which sees the user and the decided address) and a
    denied destination never reaches it. The controls: a sandbox without a proxy reaches
    the same server without touching it; cella's own SDK sends a sandbox's traffic through
    an HTTP CONNECT proxy the same way."""
    got = e2b(
        python,
        daemon,
        """
        proxied = Sandbox.create(network={
            "allow_out": ["*.e2b.test"], "deny_out": ["other.e2b.test"],
            "egress_proxy": {"address": "proxy.e2b.test:1080", "username": "alice",
                             "password": "s0cks-pw"}})
        code = "-o /dev/null -w '%{http_code}'"
        run = lambda sb, cmd: sb.commands.run(cmd + " || true").stdout
        out = {
            "through": run(proxied, "curl -s -m 30 http://api.e2b.test/through"),
            "denied": run(proxied, f"curl -s -m 30 {code} http://other.e2b.test/denied"),
            "env": run(proxied, "env; cat /proc/1/environ"),
            "info": proxied.get_info().network.get("egress_proxy"),
        }
        direct = Sandbox.create(network={"allow_out": ["api.e2b.test"]})
        out["direct"] = run(direct, "curl -s -m 30 http://api.e2b.test/direct")
        proxied.kill(); direct.kill()
        print(json.dumps(out))
        """,
    )
    seen = {r["path"] for r in net.api_seen.requests}
    assert "/through" in seen and json.loads(got["through"])["path"] == "/through"
    tunnels = net.socks.seen.requests
    assert tunnels == [{"target": f"{net.api}:80", "user": "alice"}], tunnels
    assert got["denied"] == "403"
    assert "/denied" not in {r["path"] for r in net.other_seen.requests}
    assert "s0cks-pw" not in got["env"]  # the proxy's password never enters the sandbox
    assert got["info"] == {"address": "proxy.e2b.test:1080", "username": "alice"}
    assert "/direct" in seen and len(net.socks.seen.requests) == 1  # the control: untouched
    # cella's own API: an HTTP CONNECT proxy for one sandbox, and the operator's for a tenant
    sb = admin.create(
        allow=["api.e2b.test"],
        upstream_proxy=UpstreamProxyRule(url="http://proxy-http.e2b.test:3128"),
    )
    with daemon.client(admin.create_key("corp")["key"]) as corp:
        theirs = corp.create(allow=["api.e2b.test"])
        try:
            for box, path in ((sb, "/via-connect"), (theirs, "/via-tenant")):
                out = box.exec(f"curl -s -m 30 http://api.e2b.test{path}")
                assert json.loads(out.stdout)["path"] == path
                reasons = [d.reason for d in box.egress() if d.host == "api.e2b.test"]
                assert any("via http://proxy-http.e2b.test:3128" in r for r in reasons), reasons
            tunnel = {"target": f"{net.api}:80", "user": None}
            assert net.connect.seen.requests == [tunnel, tunnel]
        finally:
            sb.delete()
            theirs.delete()


def test_workload_identity_tokens(python: Path, daemon: Daemon, net: Net) -> None:
    """`iam.tokens` with a transform that names one: the proxy puts a JWT it mints into the
    request, which verifies against the daemon's JWKS for its audience (the control: for
    another audience the verifier refuses it); the guest holds neither token nor key, and
    a host without the rule gets the guest's own header."""
    got = e2b(
        python,
        daemon,
        """
        sb = Sandbox.create(
            iam={"tokens": {"api": Secret.iam_token(audience="https://api.e2b.test",
                                                    token_type="JWT-SVID")}},
            network={"allow_out": ["api.e2b.test", "other.e2b.test"], "rules": {
                "api.e2b.test": [{"transform": lambda ctx: {
                    "headers": {"Authorization": f"Bearer {ctx.iam.tokens['api']}"}}}]}})
        curl = "curl -s -m 30 -H 'Authorization: Bearer guess' "
        out = {"id": sb.sandbox_id,
               "sent": sb.commands.run(curl + "http://api.e2b.test/identity").stdout,
               "other": sb.commands.run(curl + "http://other.e2b.test/plain").stdout,
               "env": sb.commands.run("env; cat /proc/1/environ; ls -a ~", user="root").stdout}
        sb.kill()
        print(json.dumps(out))
        """,
    )
    seen = {r["path"]: r["headers"] for r in net.api_seen.requests}
    scheme, _, token = seen["/identity"]["authorization"].partition(" ")
    assert scheme == "Bearer" and token != "guess"
    jwks = httpx2.get(f"{daemon.url}/.well-known/jwks.json").json()
    kid = jwt.get_unverified_header(token)["kid"]
    key = jwt.PyJWKSet.from_dict(jwks)[kid]
    claims = jwt.decode(token, key, algorithms=["EdDSA"], audience=AUDIENCE)
    assert claims["sub"].endswith(f"/sandbox/{got['id']}") and claims["exp"] > time.time()
    with pytest.raises(jwt.InvalidAudienceError):  # the control: another audience
        jwt.decode(token, key, algorithms=["EdDSA"], audience="https://elsewhere.test")
    other = {r["path"]: r["headers"] for r in net.other_seen.requests}
    assert other["/plain"]["authorization"] == "Bearer guess"  # no rule for that host
    assert "PRIVATE KEY" not in got["env"] and "eyJ" not in got["env"]


def test_the_async_sdk_wakes_a_paused_sandbox(python: Path, daemon: Daemon) -> None:
    """`AsyncSandbox` with the same lifecycle: a command (envd) wakes it after a pause; a
    fork of more than 20 is refused by the SDK itself before it asks (E2B's own limit)."""
    got = e2b(
        python,
        daemon,
        """
        import asyncio
        async def main():
            sb = await AsyncSandbox.create(
                timeout=120, lifecycle={"on_timeout": "pause", "auto_resume": True})
            out = {"paused": await sb.pause(),
                   "state": (await sb.get_info()).state.value}
            out["run"] = (await sb.commands.run("echo woke")).stdout
            out["after"] = (await sb.get_info()).state.value
            try:
                await sb.fork(count=21)
                out["fork"] = "sent"
            except InvalidArgumentException:
                out["fork"] = "refused"
            await sb.kill()
            return out
        print(json.dumps(asyncio.run(main())))
        """,
    )
    assert got == {
        "paused": True,
        "state": "paused",
        "run": "woke\n",
        "after": "running",
        "fork": "refused",
    }


HOST_SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = ("host=" + self.headers.get("Host", "")).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
http.server.HTTPServer(("127.0.0.1", 8000), H).serve_forever()
"""


def test_cellas_own_sdk(admin: Client, daemon: Daemon, net: Net) -> None:
    """The same in cella's core, from its own SDK: a sandbox with `auto_resume` is woken by
    a request to its service URL (which sees the `port_host` it asked for); a header rule
    puts a workload token into requests to a host, which verifies against the JWKS. The
    control: without `auto_resume` the same request is refused and the sandbox sleeps on."""
    rule = HeaderRule(hosts=["api.e2b.test"], name="X-Identity", value="{identity:svc}")
    sb = admin.create(
        allow=["api.e2b.test"],
        headers=[rule],
        identity_tokens={"svc": IdentityToken(audience="urn:svc", ttl_seconds=60)},
        port_host="${PORT}-mine.test",
        ttl_seconds=600,
        ttl_clock="running",
        auto_resume=True,
    )
    plain = admin.create(ttl_seconds=600)
    try:
        for box in (sb, plain):
            box.files.write("/tmp/host.py", HOST_SERVER)
            box.exec("sh -c 'python3 /tmp/host.py >/dev/null 2>&1 &'")
            box.exec("for i in $(seq 300); do curl -sf localhost:8000 >/dev/null && break; "
                     "sleep 0.1; done")  # fmt: skip
        assert sb.info.ttl_clock == "running" and sb.info.auto_resume is True
        sb.exec("curl -s -m 30 http://api.e2b.test/core-identity")
        seen = {r["path"]: r["headers"] for r in net.api_seen.requests}
        token = seen["/core-identity"]["x-identity"]
        jwks = httpx2.get(f"{daemon.url}/.well-known/jwks.json").json()
        key = jwt.PyJWKSet.from_dict(jwks)[jwt.get_unverified_header(token)["kid"]]
        claims = jwt.decode(token, key, algorithms=["EdDSA"], audience="urn:svc")
        assert claims["sub"].endswith(f"/sandbox/{sb.id}") and claims["exp"] - claims["iat"] == 60
        with pytest.raises(jwt.InvalidAudienceError):
            jwt.decode(token, key, algorithms=["EdDSA"], audience="urn:other")
        exposed = {box.id: box.expose(8000) for box in (sb, plain)}
        sb.pause()
        plain.pause()
        for box in (sb, plain):
            url, token = exposed[box.id].url, exposed[box.id].token
            exposed[box.id] = httpx2.get(f"{url}/", headers={"X-Cella-Service-Token": token})
        woke = exposed[sb.id]
        assert woke.status_code == 200 and woke.text == "host=8000-mine.test"
        assert admin.get(sb.id).state == "running"
        assert exposed[plain.id].status_code == 409 and admin.get(plain.id).state == "paused"
    finally:
        sb.delete()
        plain.delete()
