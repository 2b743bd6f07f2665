"""Rewrite rules end to end: a host name one sandbox calls, answered by a port of another
sandbox of the same tenant. Two real microVMs on one module daemon: `server` runs an echo
server on its loopback (what it was sent, as JSON), `caller` reaches it by the rule's name
over HTTP and HTTPS through the real egress proxy, with a secret header rule for that name;
what the server sees shows what `strip`, `redact` and `keep` did. cella's SDK sets the rules
at create and live; the pinned LangSmith SDK sets them through `proxy_config`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
from langsmith.sandbox import (
    AsyncSandboxClient,
    ResourceNotFoundError,
    SandboxClient,
    SandboxClientError,
)

from cella import Client, Sandbox, errors
from cella.models import HeaderRule, RewriteRule, SandboxPort
from tests.daemon import Daemon

pytestmark = pytest.mark.vm

SECRET = "svc-REAL-token-4e19a7"
HOST = "api.internal"
PORT = 8000
SERVER, CALLER = "rewrite-server", "rewrite-caller"
ECHO = r"""
import json, http.server

class Echo(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def body(self):
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                if size == 0:
                    self.rfile.readline()
                    return out
                out += self.rfile.read(size)
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def echo(self):
        seen = {
            "method": self.command,
            "path": self.path,
            "headers": {k.lower(): v for k, v in self.headers.items()},
        }
        body = self.body()
        seen["length"], seen["body"] = len(body), body[:1000].decode("utf-8", "replace")
        out = json.dumps(seen).encode()
        with open("/tmp/seen.jsonl", "ab") as log:
            log.write(out + b"\n")
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    do_GET = do_POST = do_PUT = echo

    def log_message(self, *args):
        pass

http.server.ThreadingHTTPServer(("127.0.0.1", 8000), Echo).serve_forever()
"""


def rule(target: str, credentials: str = "strip", port: int = PORT) -> RewriteRule:
    return RewriteRule(
        host=HOST,
        to=SandboxPort(sandbox=target, port=port),
        credentials=credentials,  # type: ignore[arg-type]
    )


HEADER = HeaderRule(hosts=[HOST], name="Authorization", value="Bearer {secret:svc-token}")


@pytest.fixture(scope="module")
def server(admin: Client) -> Iterator[Sandbox]:
    sb = admin.create(name=SERVER)
    sb.files.write("/srv/echo.py", ECHO)
    sb.exec("nohup python3 /srv/echo.py >/tmp/echo.log 2>&1 &")
    ready = f"import socket; socket.create_connection(('127.0.0.1', {PORT}), timeout=1)"
    for _ in range(100):
        if sb.exec(["python3", "-c", ready]).exit_code == 0:
            break
        time.sleep(0.2)
    else:
        raise AssertionError("the echo server never answered")
    yield sb
    with contextlib.suppress(errors.NotFound):  # the last test deletes it
        sb.delete()


@pytest.fixture(scope="module")
def caller(admin: Client, server: Sandbox) -> Iterator[Sandbox]:
    admin.put_secret("svc-token", SECRET, hosts=[HOST])
    # named by the server's name: the daemon keeps its id
    sb = admin.create(name=CALLER, headers=[HEADER], rewrites=[rule(SERVER)])
    yield sb
    sb.delete()


def fetch(sb: Sandbox, url: str, *flags: str) -> tuple[int, str]:
    """curl in the sandbox with a cookie and a header of its own: the HTTP status and the
    body it got back."""
    command = [
        "curl", "-sS", "-o", "/tmp/out", "-w", "%{http_code}", "-H", "Cookie: session=guest-c00kie",
        "-H", "X-Trace: 7", *flags, url,
    ]  # fmt: skip
    r = sb.exec(command, timeout=60)
    assert r.exit_code == 0, r.stderr.decode()
    return int(r.stdout), sb.files.read("/tmp/out").decode()


def seen(server: Sandbox) -> dict[str, Any]:
    """The last request the echo server in the other sandbox got, as it got it."""
    lines = server.files.read("/tmp/seen.jsonl").decode().splitlines()
    found: dict[str, Any] = json.loads(lines[-1])
    return found


def reach(caller: Sandbox, server: Sandbox, url: str, *flags: str) -> dict[str, Any]:
    """A request the other sandbox's server answered: what it got."""
    status, body = fetch(caller, url, *flags)
    assert status == 200, body
    got = seen(server)
    assert got == json.loads(body) or SECRET in json.dumps(got)  # (the caller's is redacted)
    return got


def rewrites_logged(sb: Sandbox, count: int) -> list[dict[str, Any]]:
    """The egress log's rewritten requests, once `count` have been reported (each is
    reported when its exchange ends)."""
    deadline = time.monotonic() + 10
    while True:
        found = [d.model_dump() for d in sb.egress() if d.rewrite is not None]
        if len(found) >= count or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def test_the_name_reaches_the_other_sandbox_with_credentials_stripped(
    caller: Sandbox, server: Sandbox
) -> None:
    assert caller.info.network.rewrites[0].to.sandbox == server.id  # the name, resolved
    for url, flags in [
        (f"http://{HOST}/plain?q=1", ()),
        (f"https://{HOST}/tls", ()),
        (f"http://{HOST}/transparent", ("--noproxy", "*")),
        (f"https://{HOST}/transparent-tls", ("--noproxy", "*")),
    ]:
        got = reach(caller, server, url, *flags)
        assert got["path"] == url.split(HOST, 1)[1]
        assert got["headers"]["host"] == HOST
        assert got["headers"]["x-trace"] == "7"  # the request's own headers pass
        # strip, the default: neither the header rule's secret nor the guest's cookie
        assert "authorization" not in got["headers"]
        assert "cookie" not in got["headers"]
        assert not any(k.startswith("x-cella") for k in got["headers"])
        assert SECRET not in json.dumps(got)
    logged = rewrites_logged(caller, 4)
    assert len(logged) >= 4
    last = logged[-1]
    assert last["host"] == HOST and last["allowed"] and last["status"] == 200
    assert last["rewrite"]["sandbox"] == server.id and last["rewrite"]["port"] == PORT
    assert last["rewrite"]["credentials"] == "strip"
    assert last["rewrite"]["headers"] == ["cookie"]  # the rule's header was never added
    assert not last["credentials"]  # no secret went with it


def test_redact_keeps_the_headers_without_their_values(caller: Sandbox, server: Sandbox) -> None:
    caller.set_network(headers=[HEADER], rewrites=[rule(server.id, "redact")])
    for url in (f"http://{HOST}/r", f"https://{HOST}/r"):
        got = reach(caller, server, url)
        assert got["headers"]["authorization"] == "Bearer redacted"  # the rule's, redacted
        assert got["headers"]["cookie"] == "redacted"
        assert SECRET not in json.dumps(got)
    caller.set_network(rewrites=[rule(server.id, "redact")])  # no header rule
    got = reach(caller, server, f"http://{HOST}/r", "-H", "Authorization: Basic Z3Vlc3Q6cHc=")
    assert got["headers"]["authorization"] == "Basic redacted"  # the guest's own, scheme kept
    got = reach(caller, server, f"http://{HOST}/r", "-H", "X-Api-Key: k3y")
    assert got["headers"]["x-api-key"] == "redacted"
    last = rewrites_logged(caller, 1)[-1]
    assert last["rewrite"]["credentials"] == "redact"
    assert last["rewrite"]["headers"] == ["cookie", "x-api-key"]


def test_keep_passes_the_secret_and_the_cookie(caller: Sandbox, server: Sandbox) -> None:
    caller.set_network(headers=[HEADER], rewrites=[rule(server.id, "keep")])
    status, body = fetch(caller, f"https://{HOST}/k", "-d", "payload")
    assert status == 200, body
    got = seen(server)
    assert got["headers"]["authorization"] == f"Bearer {SECRET}"
    assert got["headers"]["cookie"] == "session=guest-c00kie"
    assert got["method"] == "POST" and got["body"] == "payload"
    kept = rewrites_logged(caller, 1)[-1]
    assert kept["rewrite"]["credentials"] == "keep" and kept["credentials"] == ["svc-token"]
    # what came back to the caller is redacted like any response to a sandbox with secrets
    assert SECRET not in body and "[secret:svc-token]" in body


def test_without_the_rule_the_proxy_refuses_the_name(caller: Sandbox, server: Sandbox) -> None:
    caller.set_network(headers=[HEADER])
    status, body = fetch(caller, f"http://{HOST}/none")
    assert status == 403 and "no rule allows it" in body
    r = caller.exec(["curl", "-sS", f"https://{HOST}/none"])
    assert r.exit_code == 56 and b"CONNECT tunnel failed, response 403" in r.stderr
    assert seen(server)["path"] != "/none"
    # a deny rule wins over a rewrite, as over any allow rule
    caller.set_network(deny=[HOST], rewrites=[rule(server.id)])
    status, body = fetch(caller, f"http://{HOST}/denied")
    assert status == 403 and f"denied by rule {HOST}" in body
    # the control: the same request with the rule alone goes through
    caller.set_network(rewrites=[rule(server.id)])
    assert reach(caller, server, f"http://{HOST}/again")["path"] == "/again"


def test_rules_naming_what_cella_cannot_route_are_refused(
    admin: Client, daemon: Daemon, caller: Sandbox, server: Sandbox
) -> None:
    before = caller.info.network.rewrites
    with pytest.raises(errors.InvalidArgument, match="no sandbox 'nope' of this tenant"):
        caller.set_network(rewrites=[rule("nope")])
    for host in ("10.0.0.1", "*.internal", "cella.api", "api.internal:80"):
        with pytest.raises(errors.InvalidArgument):
            bad = {"host": host, "to": {"sandbox": server.id, "port": PORT}}
            admin.request("PUT", f"/v1/sandboxes/{caller.id}/network", json={"rewrites": [bad]})
    # another tenant's sandbox does not exist for this one: refused before anything boots
    with daemon.client(admin.create_key("bob-rewrites")["key"]) as bob:
        with pytest.raises(errors.InvalidArgument, match="of this tenant"):
            bob.create(rewrites=[rule(server.id)])
        assert bob.list() == []
    # nothing of the refused rules was kept
    assert caller.refresh().info.network.rewrites == before


def test_a_body_beyond_what_the_proxy_buffers_streams_through(
    caller: Sandbox, server: Sandbox
) -> None:
    """Over 16 MiB the proxy streams a request body: the request was routed before it went."""
    size = 20 << 20
    caller.exec(f"head -c {size} /dev/zero > /tmp/big")
    got = reach(caller, server, f"http://{HOST}/big", "--data-binary", "@/tmp/big")
    assert got["method"] == "POST" and got["length"] == size


def test_a_port_nothing_listens_on_is_a_502(caller: Sandbox, server: Sandbox) -> None:
    caller.set_network(rewrites=[rule(server.id, port=9)])
    status, body = fetch(caller, f"http://{HOST}/closed")
    assert status == 502 and "port_closed" in body
    caller.set_network(rewrites=[rule(server.id)])


def test_the_langsmith_sdk_sets_a_rewrite_rule(
    daemon: Daemon, caller: Sandbox, server: Sandbox
) -> None:
    """`proxy_config` rules of type `rewrite` in the shape of the langsmith package's
    generated `RuleRewrite`: `match_hosts` and `rewrite: {sandbox, port, credentials}`."""
    api = f"{daemon.url}/api/v2/sandboxes"
    ls_rule = {
        "name": "to-server",
        "type": "rewrite",
        "match_hosts": [HOST],
        "rewrite": {"sandbox": SERVER, "port": PORT, "credentials": "redact"},
    }
    with SandboxClient(api_endpoint=api, api_key=daemon.admin_key) as client:
        client.update_sandbox(CALLER, proxy_config={"rules": [ls_rule]})
        got = reach(caller, server, f"https://{HOST}/ls", "-H", "Authorization: Bearer mine")
        assert got["headers"]["authorization"] == "Bearer redacted"
        # a create naming no sandbox of the tenant is refused before anything boots
        bad = {**ls_rule, "rewrite": {"sandbox": "nope", "port": PORT}}
        with pytest.raises(SandboxClientError, match="no sandbox 'nope' of this tenant"):
            client.create_sandbox(name="never-made", proxy_config={"rules": [bad]})
        with pytest.raises(ResourceNotFoundError):
            client.get_sandbox("never-made")
        # what cella cannot do is refused by name: a rewrite to an outside host, path matching
        for extra in ({"rewrite": {"host": "example.com", "port": 443}}, {"match_paths": ["/x"]}):
            with pytest.raises(SandboxClientError, match="not supported"):
                client.update_sandbox(CALLER, proxy_config={"rules": [{**ls_rule, **extra}]})

    async def keep() -> None:
        async with AsyncSandboxClient(api_endpoint=api, api_key=daemon.admin_key) as client:
            keep_rule = {**ls_rule, "rewrite": {**ls_rule["rewrite"], "credentials": "keep"}}
            await client.update_sandbox(CALLER, proxy_config={"rules": [keep_rule]})

    asyncio.run(keep())
    got = reach(caller, server, f"http://{HOST}/ls", "-H", "Authorization: Bearer mine")
    assert got["headers"]["authorization"] == "Bearer mine"
    rules = caller.refresh().info.network.rewrites
    assert [(r.host, r.to.sandbox, r.credentials) for r in rules] == [(HOST, server.id, "keep")]


def test_the_cli_sets_a_rewrite(daemon: Daemon, caller: Sandbox, server: Sandbox) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "cella.cli", "sandbox", "network", caller.id, *args]
        return subprocess.run(command, env=daemon.env(), capture_output=True, text=True)

    done = cli("--rewrite", f"{HOST}={SERVER}:{PORT}:redact", "--json")
    assert done.returncode == 0, done.stderr
    [given] = json.loads(done.stdout)["rewrites"]
    assert given == {
        "host": HOST,
        "to": {"sandbox": server.id, "port": PORT},
        "credentials": "redact",
    }
    got = reach(caller, server, f"http://{HOST}/cli", "-H", "Authorization: Bearer mine")
    assert got["headers"]["authorization"] == "Bearer redacted"
    refused = cli("--rewrite", f"{HOST}={SERVER}")  # no port: refused before the daemon
    assert refused.returncode != 0 and "expected" in refused.stderr
    assert caller.refresh().info.network.rewrites[0].credentials == "redact"


def test_a_rule_holds_only_while_its_setter_may_exec_in_the_target(
    admin: Client, daemon: Daemon, caller: Sandbox, server: Sandbox
) -> None:
    """Checked on every request, not only when set: a member's rule works while the
    target is shared with her and is a 403 once the share is taken back; the tenant
    owner's own rule keeps working (the control). A fork's inherited rules keep their
    setter: once her key is revoked, her rule is refused in the caller and in its fork."""
    alice = admin.create_key("admin", principal="alice", roles=["member"])
    caller.share({"alice": "manage"})
    server.share({"alice": "exec"}, visibility="private")

    def set_by_alice() -> None:
        with daemon.client(alice["key"]) as client:
            client.get(caller.id).set_network(rewrites=[rule(server.id)])

    fork = None
    try:
        set_by_alice()
        assert reach(caller, server, f"http://{HOST}/shared")["path"] == "/shared"
        server.share({})  # taken back: her rule's next request is refused
        for url in (f"http://{HOST}/unshared", f"https://{HOST}/unshared"):
            status, body = fetch(caller, url)
            assert status == 403 and "may no longer exec in sandbox" in body, body
        assert seen(server)["path"] != "/unshared"
        # the control: the owner's own rule to the same private sandbox keeps working
        caller.set_network(rewrites=[rule(server.id)])
        assert reach(caller, server, f"http://{HOST}/owner")["path"] == "/owner"
        # shared again, her rule works again, in the caller and in a fork of it
        server.share({"alice": "exec"})
        set_by_alice()
        assert reach(caller, server, f"http://{HOST}/again")["path"] == "/again"
        [fork] = caller.fork()
        assert fork.info.network.rewrites == caller.refresh().info.network.rewrites
        assert reach(fork, server, f"http://{HOST}/forked")["path"] == "/forked"
        admin.revoke_key(alice["id"])  # her key gone: her rule with it, wherever it went
        for box in (caller, fork):
            status, body = fetch(box, f"http://{HOST}/revoked")
            assert status == 403 and "the key that set the rule is revoked" in body, body
        assert seen(server)["path"] != "/revoked"
    finally:
        if fork is not None:
            fork.delete()
        server.share({}, visibility="tenant")
        caller.share({})
    caller.set_network(rewrites=[rule(server.id)])  # the owner's again: it goes through
    assert reach(caller, server, f"http://{HOST}/restored")["path"] == "/restored"


def test_a_stopped_or_deleted_target_is_a_clear_503(caller: Sandbox, server: Sandbox) -> None:
    """Last: the server's sandbox stops, then goes. The caller's request is answered at
    once, each time."""
    caller.set_network(rewrites=[rule(server.id)])
    assert reach(caller, server, f"http://{HOST}/before")["path"] == "/before"  # the control
    server.stop()
    status, body = fetch(caller, f"http://{HOST}/after", "--max-time", "30")
    assert status == 503, body
    assert "sandbox_unavailable" in body and "not running" in body
    logged = rewrites_logged(caller, 1)
    assert any(d["status"] == 503 for d in logged)
    server.delete()  # a rule outliving its target: the same clear answer
    status, body = fetch(caller, f"http://{HOST}/gone", "--max-time", "30")
    assert status == 503 and "no longer exists" in body
