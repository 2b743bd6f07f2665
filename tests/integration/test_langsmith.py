"""The official LangSmith SDK (`langsmith==0.14.17`, unchanged) driving a real cella daemon:
every section of its sandbox README that cella serves, sync and async, on real microVMs."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from langsmith.sandbox import (
    AsyncSandboxClient,
    CommandTimeoutError,
    QuotaExceededError,
    ResourceNotFoundError,
    Sandbox,
    SandboxClient,
    SandboxClientError,
    SandboxOperationError,
    ValidationError,
)
from langsmith.sandbox._verify import SandboxTokenVerificationError, SandboxTokenVerifier

from cella import Client, errors
from cella.models import CallbackRule
from tests.daemon import Daemon, DaemonFactory
from tests.netservers import EchoHandler, Recorder, Servers, free_loopback_block

pytestmark = pytest.mark.vm


class CallbackHandler(http.server.BaseHTTPRequestHandler):
    """A proxy callback: keeps what it was asked (body, signature) and answers the last of
    `answers`."""

    recorder: Recorder
    answers: list[dict[str, Any]]
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        signature = self.headers.get("X-LangSmith-Signature-JWT")
        self.recorder.add({"path": self.path, "body": body, "signature": signature})
        out = json.dumps(self.answers[-1]).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def web() -> Iterator[dict[str, Any]]:
    prefix = free_loopback_block()
    servers = Servers()
    seen = servers.start(EchoHandler, (f"{prefix}.1", 80))
    other_seen = servers.start(EchoHandler, (f"{prefix}.2", 80))
    answers: list[dict[str, Any]] = [{"allow": False}]
    asked = servers.start(CallbackHandler, (f"{prefix}.3", 80), answers=answers)
    yield {
        "web": f"{prefix}.1",
        "other": f"{prefix}.2",
        "seen": seen,
        "other_seen": other_seen,
        "callback": f"{prefix}.3",
        "answers": answers,
        "asked": asked,
    }
    servers.close()


QUOTA = 6  # the live sandboxes a tenant may hold on this module's daemon
LIVE = {"creating", "running", "paused", "starting", "stopping"}
MIB = 1 << 20


@pytest.fixture(scope="module")
def daemon_settings(web: dict[str, str]) -> dict[str, str]:
    hosts = {"web.test": web["web"], "other.test": web["other"], "callback.test": web["callback"]}
    return {
        "pool_size": "1",
        "egress_hosts": json.dumps(hosts),
        "max_sandboxes_per_tenant": str(QUOTA),
    }


@pytest.fixture(scope="module")
def client(daemon: Daemon) -> Iterator[SandboxClient]:
    c = SandboxClient(api_endpoint=f"{daemon.url}/api/v2/sandboxes", api_key=daemon.admin_key)
    yield c
    c.close()


@pytest.fixture(scope="module")
def sb(client: SandboxClient) -> Iterator[Sandbox]:
    with client.sandbox(name="shared") as box:
        yield box


def test_the_two_environment_variables_are_all_it_takes(daemon: Daemon) -> None:
    script = (
        "from langsmith.sandbox import SandboxClient\n"
        "with SandboxClient().sandbox() as sb:\n"
        "    r = sb.run(\"python -c 'print(1+1)'\")\n"
        "    print(r.stdout.strip(), r.exit_code, sb.name.startswith('sandbox-'))\n"
    )
    env = {
        **os.environ,
        "LANGSMITH_ENDPOINT": daemon.url,
        "LANGSMITH_API_KEY": daemon.admin_key,
    }
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["2", "0", "True"]


def test_run_streams_output_with_callbacks(sb: Sandbox) -> None:
    seen: list[tuple[str, str]] = []
    result = sb.run(
        "for i in 1 2 3; do echo out$i; echo err$i >&2; sleep 0.1; done; exit 4",
        on_stdout=lambda s: seen.append(("out", s)),
        on_stderr=lambda s: seen.append(("err", s)),
    )
    assert result.exit_code == 4 and not result.success
    assert result.stdout == "out1\nout2\nout3\n" and result.stderr == "err1\nerr2\nerr3\n"
    assert "".join(s for k, s in seen if k == "out") == result.stdout
    # non-UTF-8 bytes keep the offsets exact
    odd = sb.run("printf 'a\\377b\\303'; printf '\\251z'")
    assert odd.stdout == "a?b\u00e9z"


def test_handles_stdin_kill_and_reconnect(sb: Sandbox) -> None:
    handle = sb.run("read line; echo got:$line", wait=False, close_input=False)
    assert handle.command_id and handle.pid
    handle.send_input("hello\n")
    assert handle.result.stdout == "got:hello\n"

    slow = sb.run("for i in $(seq 1 30); do echo tick$i; sleep 0.1; done", wait=False)
    first = next(iter(slow))
    assert first.data.startswith("tick1")
    # a second client attaches by id and gets everything from the start
    again = sb.reconnect(slow.command_id)
    assert again.result.stdout == "".join(f"tick{i}\n" for i in range(1, 31))

    forever = sb.run("sleep 3600", timeout=0, wait=False)
    forever.kill()
    gone = sb.run(f"sleep 1; ps -p {forever.pid} >/dev/null && echo alive || echo gone")
    assert gone.stdout == "gone\n"


def test_timeouts_and_pty(sb: Sandbox) -> None:
    with pytest.raises(CommandTimeoutError):
        sb.run("sleep 30", timeout=2)
    assert sb.run("sleep 1; echo done", timeout=0).stdout == "done\n"
    repl = sb.run("python3 -i -q", pty=True, wait=False)
    out: list[str] = []

    def reader() -> None:
        for chunk in repl:
            out.append(chunk.data)

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    repl.send_input("print(6 * 7)\n")
    for _ in range(100):
        if "42" in "".join(out):
            break
        time.sleep(0.05)
    repl.send_input("exit()\n")
    thread.join(10)
    assert "42" in "".join(out)
    assert sb.run("tty", pty=True).stdout.startswith("/dev/pts/")


def test_files(sb: Sandbox) -> None:
    sb.write("/app/deep/script.py", "print('from a file')\n")
    assert sb.run("python /app/deep/script.py").stdout == "from a file\n"
    blob = bytes(range(256)) * 64
    sb.write("/app/blob.bin", blob)
    assert sb.read("/app/blob.bin") == blob
    stat = sb.stat("/app/blob.bin")
    assert stat.size_bytes == len(blob) and stat.etag
    part = sb.read_range("/app/blob.bin", start=10, end=19)
    assert part.content == blob[10:20] and part.partial and part.total_bytes == len(blob)
    tail = sb.read_range("/app/blob.bin", suffix_bytes=5)
    assert tail.content == blob[-5:]
    assert sb.read_range("/app/blob.bin", start=0, if_none_match=stat.etag).unchanged
    sb.write("notes.txt", "relative to home\n")
    assert sb.read("/root/notes.txt") == b"relative to home\n"
    assert [m.path for m in sb.glob("**/*.py", "/app").matches] == ["/app/deep/script.py"]
    assert {m.path for m in sb.ls("/app").matches} == {"/app/deep", "/app/blob.bin"}
    hits = sb.grep("from a", "/app", glob="*.py").matches
    assert [(h.path, h.line) for h in hits] == [("/app/deep/script.py", 1)]
    with pytest.raises(ResourceNotFoundError):
        sb.read("/no/such/file")


SERVER = "cd /srv && nohup python3 -m http.server 8000 --bind 127.0.0.1 >/dev/null 2>&1 &"


def test_tunnels_and_service_urls(sb: Sandbox) -> None:
    sb.write("/srv/index.txt", "served from the guest\n")
    sb.run(SERVER)
    wait = "(echo > /dev/tcp/127.0.0.1/8000) 2>/dev/null && break; sleep 0.1"
    sb.run(f"for i in $(seq 100); do {wait}; done")
    with sb.tunnel(remote_port=8000, local_port=0) as tunnel:
        for _ in range(3):
            got = httpx.get(f"http://127.0.0.1:{tunnel.local_port}/index.txt", timeout=30)
            assert got.text == "served from the guest\n"
        big = "x" * (1 << 20)
        sb.write("/srv/big.txt", big)
        assert httpx.get(f"http://127.0.0.1:{tunnel.local_port}/big.txt", timeout=60).text == big
    service = sb.service(port=8000, expires_in_seconds=120)
    assert service.get("/index.txt").text == "served from the guest\n"
    assert httpx.get(f"{service.service_url}/index.txt").status_code == 403  # no token


WHOAMI = """
import http.server, json
class Echo(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        seen = {k.lower(): self.headers.get_all(k) for k in set(self.headers.keys())}
        body = json.dumps({"path": self.path, "headers": seen}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    do_POST = do_GET
http.server.HTTPServer(("127.0.0.1", 8010), Echo).serve_forever()
"""


def test_login_service_urls_tell_the_guest_who_signed_in(
    sb: Sandbox, client: SandboxClient, daemon: Daemon
) -> None:
    sb.write("/srv/whoami.py", WHOAMI)
    sb.run("nohup python3 /srv/whoami.py >/dev/null 2>&1 &")
    wait = "(echo > /dev/tcp/127.0.0.1/8010) 2>/dev/null && break; sleep 0.1"
    sb.run(f"for i in $(seq 100); do {wait}; done")
    login = client.service(sb.name, 8010, access="restricted")  # the client's call only
    assert login.access == "restricted" and login.url.endswith("/")

    # a key of the tenant opens it (LangSmith's header); a forged identity is replaced
    forged = {"x-langsmith-user-token": "forged", "x-langsmith-user-id": "mallory"}
    got = httpx.get(f"{login.url}who?x=1", headers={"x-api-key": daemon.admin_key, **forged})
    assert got.status_code == 200, got.text
    seen = got.json()["headers"]
    assert got.json()["path"] == "/who?x=1"
    (token,) = seen["x-langsmith-user-token"]
    (user_id,) = seen["x-langsmith-user-id"]
    assert token != "forged" and user_id != "mallory" and user_id.startswith("key-")
    assert "x-api-key" not in seen and "authorization" not in seen  # the key stays outside
    (host,) = seen["host"]
    assert host == daemon.url.partition("://")[2]

    # the guest's server verifies it as LangSmith documents, against the daemon's JWKS
    verifier = SandboxTokenVerifier(api_url=daemon.url)
    user = verifier.verify_user_token(token, audience=host, issuer=daemon.url)
    assert user.subject == user_id and user.expires_at.timestamp() > time.time()
    again = asyncio.run(
        SandboxTokenVerifier(api_url=daemon.url).averify_user_token(token, audience=host)
    )
    assert again.subject == user_id
    # ...and refuses what the daemon did not sign, or signed for another host
    with pytest.raises(SandboxTokenVerificationError, match="empty"):
        verifier.verify_user_token("", audience=host)
    with pytest.raises(SandboxTokenVerificationError, match="invalid token"):
        verifier.verify_user_token(token, audience="other.example")
    kid = jwt.get_unverified_header(token)["kid"]
    claims = jwt.decode(token, options={"verify_signature": False})
    impostor = jwt.encode(
        claims, Ed25519PrivateKey.generate(), algorithm="EdDSA", headers={"kid": kid}
    )
    with pytest.raises(SandboxTokenVerificationError, match="invalid token"):
        verifier.verify_user_token(impostor, audience=host)

    # a cella key (Bearer) opens it too; no key, or another tenant's, does not
    bearer = httpx.get(login.url, headers={"authorization": f"Bearer {daemon.admin_key}"})
    assert bearer.status_code == 200 and bearer.json()["headers"]["x-langsmith-user-token"]
    assert httpx.get(login.url).status_code == 401
    with daemon.client() as admin:
        stranger = admin.create_key("stranger")["key"]
        assert httpx.get(login.url, headers={"x-api-key": stranger}).status_code == 404
        # cella's own call gives the same URL
        made = admin.get(sb.id).login_url(8010)
    assert made.url.rstrip("/") == login.url.rstrip("/")
    assert made.jwks_url == f"{daemon.url}/.well-known/jwks.json"
    expose = [sys.executable, "-m", "cella.cli", "sandbox", "expose", sb.id, "8010", "--login"]
    out = subprocess.run([*expose, "--json"], env=daemon.env(), capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["url"] == made.url

    # the token mode beside it: its own token opens it, and the guest gets no user
    token_mode = sb.service(port=8010, expires_in_seconds=60)
    plain = token_mode.get("/", headers=forged).json()["headers"]
    assert "x-langsmith-user-token" not in plain and "x-langsmith-user-id" not in plain
    with pytest.raises(ValueError):
        client.service(sb.name, 8010, access="everyone")  # type: ignore[call-overload]


def signed_by_the_daemon(daemon: Daemon, claims: dict[str, Any]) -> str:
    """A token signed with the daemon's own current key (its file in DATA_DIR/signing)."""
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    newest = max((daemon.data_dir / "signing").glob("*.pem"), key=lambda p: p.name)
    key = load_pem_private_key(newest.read_bytes(), password=None)
    kid = newest.stem.partition("-")[2]
    return jwt.encode(claims, key, algorithm="EdDSA", headers={"kid": kid})  # type: ignore[arg-type]


def test_download_links_open_one_file_without_a_key(
    sb: Sandbox, client: SandboxClient, daemon: Daemon
) -> None:
    sb.write("out/report.csv", "a,b\n1,2\n")
    sb.write("out/private.txt", "not shared\n")
    link = sb.generate_download_url("out/report.csv", expires_in_seconds=300)
    assert link.expires_at and link.token in link.download_url
    got = httpx.get(link.download_url)  # no key
    assert got.status_code == 200 and got.text == "a,b\n1,2\n"
    assert got.headers["content-disposition"].startswith('attachment; filename="report.csv"')
    assert got.headers["content-type"].startswith("text/csv")
    part = httpx.get(link.download_url, headers={"range": "bytes=4-"})
    assert part.status_code == 206 and part.text == "1,2\n"
    assert part.headers["content-range"] == "bytes 4-7/8"
    head = httpx.head(link.download_url)
    assert head.status_code == 200 and head.headers["content-length"] == "8" and not head.content
    beyond = httpx.get(link.download_url, headers={"range": "bytes=100-"})
    assert beyond.status_code == 416 and beyond.headers["content-range"] == "bytes */8"
    typed = sb.generate_download_url("out/report.csv", content_type="application/x-report")
    assert httpx.get(typed.download_url).headers["content-type"] == "application/x-report"
    page = sb.generate_download_url("out/report.csv", content_type="text/html")
    page_headers = httpx.get(page.download_url).headers  # a guest's HTML on the daemon's origin
    assert page_headers["content-security-policy"].split()[0] == "sandbox"  # an opaque origin
    with pytest.raises(SandboxClientError, match="media type"):  # a header of its own: no
        sb.generate_download_url("out/report.csv", content_type="text/csv\r\nX-Evil: 1")

    # the same token for another path is refused; that file's own link opens it
    elsewhere = httpx.get(link.download_url.replace("report.csv", "private.txt"))
    assert elsewhere.status_code == 403 and "another file" in elsewhere.text
    own = client.generate_download_url(sb.name, "/root/out/private.txt")
    assert own.expires_at is None  # none asked for: it never expires
    assert httpx.get(own.download_url).text == "not shared\n"

    # a changed signature, and a payload changed under the old signature, are refused
    url, _, token = link.download_url.partition("?token=")
    head_b64, body_b64, sig = token.split(".")
    flipped = sig[:10] + ("A" if sig[10] != "A" else "B") + sig[11:]
    assert httpx.get(f"{url}?token={head_b64}.{body_b64}.{flipped}").status_code == 403
    claims = jwt.decode(token, options={"verify_signature": False})
    moved = {**claims, "path": "/root/out/private.txt"}
    moved_b64 = jwt.utils.base64url_encode(json.dumps(moved).encode()).decode()
    private_url = url.replace("report.csv", "private.txt")
    assert httpx.get(f"{private_url}?token={head_b64}.{moved_b64}.{sig}").status_code == 403

    # an expired link is refused; the same claims unexpired (the control) are served
    past = signed_by_the_daemon(daemon, {**claims, "exp": int(time.time()) - 120})
    refused = httpx.get(f"{url}?token={past}")
    assert refused.status_code == 403 and "expired" in refused.text
    fresh = signed_by_the_daemon(daemon, {**claims, "exp": int(time.time()) + 120})
    assert httpx.get(f"{url}?token={fresh}").text == "a,b\n1,2\n"
    assert httpx.get(url).status_code == 403  # no token at all

    # what the daemon signs verifies against its JWKS (public keys only, no key needed)
    keys = httpx.get(f"{daemon.url}/.well-known/jwks.json").json()["keys"]
    assert keys and all("d" not in k for k in keys)
    jwk = jwt.PyJWKSet.from_dict({"keys": keys})[jwt.get_unverified_header(token)["kid"]]
    assert jwt.decode(token, jwk, algorithms=["EdDSA"], audience=claims["aud"])["sub"] == sb.id


def test_download_links_from_the_async_sdk_cella_sdk_and_cli(sb: Sandbox, daemon: Daemon) -> None:
    sb.write("/root/out/async.txt", "made async\n")

    async def made() -> tuple[str, str]:
        async with AsyncSandboxClient(
            api_endpoint=f"{daemon.url}/api/v2/sandboxes", api_key=daemon.admin_key
        ) as aclient:
            box = await aclient.get_sandbox(sb.name)
            inline = await box.generate_download_url(
                "out/async.txt", expires_in_seconds=60, content_disposition="inline"
            )
            plain = await aclient.generate_download_url(sb.name, "out/async.txt")
            return inline.download_url, plain.download_url

    inline_url, plain_url = asyncio.run(made())
    inline = httpx.get(inline_url)
    assert inline.text == "made async\n"
    assert inline.headers["content-disposition"].startswith('inline; filename="async.txt"')
    assert httpx.get(plain_url).headers["content-disposition"].startswith("attachment")

    with daemon.client() as cella:
        files = cella.get(sb.id).files
        link = files.download_url("/root/out/async.txt", expires_in_seconds=60)
        with pytest.raises(errors.InvalidArgument, match="absolute"):
            files.download_url("out/async.txt")
    assert link.expires_at is not None and link.path == "/root/out/async.txt"
    assert httpx.get(link.url).text == "made async\n"

    out = subprocess.run(
        [sys.executable, "-m", "cella.cli", "files", "url", sb.id, "/root/out/async.txt", "--json"],
        env=daemon.env(),
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert httpx.get(json.loads(out.stdout)["url"]).text == "made async\n"


def test_rotated_signing_keys_keep_verifying_until_retired(sb: Sandbox, daemon: Daemon) -> None:
    def kids() -> set[str]:
        keys = httpx.get(f"{daemon.url}/.well-known/jwks.json").json()["keys"]
        return {k["kid"] for k in keys}

    sb.write("/root/out/rot.txt", "rotated\n")
    with daemon.client() as admin:
        files = admin.get(sb.id).files
        before = files.download_url("/root/out/rot.txt", expires_in_seconds=600)
        old_kid = jwt.get_unverified_header(before.token)["kid"]
        keys = admin.rotate_signing_key()
        (new_kid,) = [k.kid for k in keys.keys if k.current]
        assert new_kid != old_kid and old_kid in {k.kid for k in keys.keys}
        assert {old_kid, new_kid} <= kids()
        after = files.download_url("/root/out/rot.txt", expires_in_seconds=600)
        assert jwt.get_unverified_header(after.token)["kid"] == new_kid
        assert httpx.get(before.url).text == "rotated\n"  # the old key still verifies

        retire = [sys.executable, "-m", "cella.cli", "keys", "signing-retire", old_kid]
        out = subprocess.run(retire, env=daemon.env(), capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert httpx.get(before.url).status_code == 403  # retired: what it signed is refused
        assert httpx.get(after.url).text == "rotated\n"  # the control: the current key's
        assert old_kid not in kids() and new_kid in kids()
        assert [k.kid for k in admin.signing_keys().keys] == [new_kid]
        listed = [sys.executable, "-m", "cella.cli", "keys", "signing", "--json"]
        out = subprocess.run(listed, env=daemon.env(), capture_output=True, text=True)
        assert [(k["kid"], k["current"]) for k in json.loads(out.stdout)["keys"]] == [
            (new_kid, True)
        ]
        with pytest.raises(errors.Conflict):
            admin.retire_signing_key(new_kid)  # the key that signs stays
        with pytest.raises(errors.NotFound):
            admin.retire_signing_key(old_kid)
        tenant_key = admin.create_key("rotator")["key"]
    with daemon.client(tenant_key) as tenant, pytest.raises(errors.PermissionDenied):
        tenant.rotate_signing_key()


def test_proxy_callbacks_decide_and_add_headers(
    client: SandboxClient, daemon: Daemon, web: dict[str, Any]
) -> None:
    answers, asked = web["answers"], web["asked"]
    verifier = SandboxTokenVerifier(jwks_url=f"{daemon.url}/.well-known/jwks.json")
    ask = "http://callback.test/ask"
    proxy_config = {
        "access_control": {"allow_list": ["web.test", "other.test"]},
        "rules": [{"name": "ask", "type": "callback", "match_hosts": ["web.test"],
                   "callback": {"url": ask}}],
    }  # fmt: skip
    with client.sandbox(name="called", proxy_config=proxy_config) as box, daemon.client() as admin:
        answers.append({"allow": True, "headers": {"X-From-Callback": "yes"}, "ttl_seconds": 600})
        got = json.loads(box.run("curl -sS http://web.test/one").stdout)
        assert got["path"] == "/one" and got["headers"]["x-from-callback"] == "yes"
        (first,) = asked.requests
        # signed as LangSmith's callbacks are: the SDK's verifier accepts it
        called = verifier.verify_callback(body=first["body"], signature=first["signature"], aud=ask)
        assert (called.host, called.port, called.request) == ("web.test", 80, None)
        assert called.identity.sandbox_id == box.id and called.identity.tenant_id == "admin"
        (current,) = [k.kid for k in admin.signing_keys().keys if k.current]
        assert jwt.get_unverified_header(first["signature"])["kid"] == current  # after rotations
        # ...and refuses it for another body or another callback URL
        with pytest.raises(SandboxTokenVerificationError, match="body"):
            verifier.verify_callback(body=first["body"] + b" ", signature=first["signature"])
        with pytest.raises(SandboxTokenVerificationError):
            verifier.verify_callback(
                body=first["body"], signature=first["signature"], aud=ask + "x"
            )

        # the answer is kept for its TTL: the next request asks no one; a host without a
        # callback is not asked at all
        assert (
            "x-from-callback"
            in json.loads(box.run("curl -sS http://web.test/two").stdout)["headers"]
        )
        assert (
            "x-from-callback"
            not in json.loads(box.run("curl -sS http://other.test/").stdout)["headers"]
        )
        assert len(asked.requests) == 1

        # full_request: the request goes along, and a refusal is a 403 the server never sees
        full = CallbackRule(hosts=["web.test"], url=f"{ask}-full", full_request=True)
        admin.get(box.id).set_network(allow=["web.test"], callbacks=[full])
        answers.append({"allow": False, "reason": "not today"})
        refused = box.run("curl -sS -X POST -d hello http://web.test/three?x=1").stdout
        assert "denied" in refused and "not today" in refused
        assert "/three?x=1" not in [r["path"] for r in web["seen"].requests]
        last = asked.requests[-1]
        sent = verifier.verify_callback(
            body=last["body"], signature=last["signature"], aud=f"{ask}-full"
        )
        assert sent.request is not None and sent.request.method == "POST"
        assert (sent.request.path, sent.request.query, sent.request.body) == (
            "/three",
            "x=1",
            b"hello",
        )
        answers.append({"allow": True})  # asked again each time: full requests are not kept
        assert json.loads(box.run("curl -sS http://web.test/four").stdout)["path"] == "/four"
        assert asked.requests[-1]["path"] == "/ask-full"

        # a callback that is not reachable (the boundary holds its address too) refuses
        gone = CallbackRule(hosts=["web.test"], url="http://127.0.0.1:9/ask", timeout_seconds=2)
        admin.get(box.id).set_network(allow=["web.test"], callbacks=[gone])
        assert "denied" in box.run("curl -sS http://web.test/five").stdout


def test_start_stop_keeps_files(client: SandboxClient) -> None:
    with client.sandbox(name="my-vm") as box:
        box.run("echo hello > /tmp/state.txt")
        link = box.generate_download_url("/tmp/state.txt", expires_in_seconds=600)
        box.stop()
        assert client.get_sandbox("my-vm").status == "stopped"
        box.start(timeout=120)
        assert box.run("cat /tmp/state.txt").stdout == "hello\n"
        box.stop()  # a download link wakes a stopped box, as LangSmith's do
        assert httpx.get(link.download_url, timeout=120).text == "hello\n"
        assert client.get_sandbox("my-vm").status == "ready"


def test_snapshots_with_moving_tags(client: SandboxClient) -> None:
    with client.sandbox(name="setup-box") as box:
        box.write("/opt/config.yaml", "model: small\n")
        first = box.capture_snapshot("my-env")
        assert first.status == "ready" and first.source_sandbox_id and "latest" in first.tags
        box.write("/opt/config.yaml", "model: large\n")
        second = client.capture_snapshot("setup-box", "my-env", tag="v2")
        assert "v2" in second.tags
    tags = {t.tag: t.snapshot_id for t in client.list_snapshot_tags("my-env")}
    assert tags == {"latest": first.id, "v2": second.id}
    assert client.get_snapshot("my-env:v2").id == second.id
    assert client.get_snapshot("my-env").id == first.id
    assert [s.id for s in client.list_snapshots(name_contains="MY-ENV", limit=1)] == [first.id]
    with client.sandbox(snapshot="my-env:v2", name="from-v2") as booted:
        assert booted.read("/opt/config.yaml") == b"model: large\n"
    with client.sandbox(snapshot_id=first.id) as booted:
        assert booted.read("/opt/config.yaml") == b"model: small\n"
    client.delete_snapshot(second.id)
    assert [t.tag for t in client.list_snapshot_tags("my-env")] == ["latest"]
    with pytest.raises(ResourceNotFoundError):
        client.get_snapshot(second.id)
    # an image is a registry reference: never a file on the daemon's host
    with pytest.raises(SandboxClientError, match="not a registry image reference"):
        client.create_snapshot("pg", docker_image="/etc/passwd", fs_capacity_bytes=1 << 30)
    assert "pg" not in [s.name for s in client.list_snapshots()]


def test_retention_and_updates(client: SandboxClient) -> None:
    box = client.create_sandbox(name="kept", idle_ttl_seconds=300, delete_after_stop_seconds=3600)
    try:
        assert (box.idle_ttl_seconds, box.delete_after_stop_seconds) == (300, 3600)
        box = client.update_sandbox("kept", new_name="kept2", idle_ttl_seconds=1800)
        assert (box.name, box.idle_ttl_seconds) == ("kept2", 1800)
        box = client.update_sandbox("kept2", idle_ttl_seconds=0, delete_after_stop_seconds=0)
        assert (box.idle_ttl_seconds, box.delete_after_stop_seconds) == (0, 0)
        assert "kept2" in [s.name for s in client.list_sandboxes()]
    finally:
        client.delete_sandbox("kept2")
    with pytest.raises(ResourceNotFoundError):
        client.get_sandbox("kept2")


def test_not_ready_yet_then_waited_for(client: SandboxClient) -> None:
    box = client.create_sandbox(name="later", wait_for_ready=False)
    assert box.status in ("provisioning", "ready")
    ready = client.wait_for_sandbox("later", timeout=60)
    assert ready.status == "ready" and ready.run("echo up").stdout == "up\n"
    client.delete_sandbox("later")


def test_egress_allow_and_deny_lists(client: SandboxClient, web: dict[str, str]) -> None:
    allow = {"access_control": {"allow_list": ["web.test"]}}
    with client.sandbox(name="net-allow", proxy_config=allow) as box:
        assert json.loads(box.run("curl -sS http://web.test/a").stdout)["path"] == "/a"
        assert "denied" in box.run("curl -sS http://other.test/").stdout
    deny = {"access_control": {"deny_list": ["other.test"]}}
    with client.sandbox(name="net-deny", proxy_config=deny) as box:
        assert json.loads(box.run("curl -sS http://web.test/b").stdout)["path"] == "/b"
        assert "denied" in box.run("curl -sS http://other.test/").stdout
    aws = {"rules": [{"name": "aws", "type": "aws", "aws": {"role_arn": "arn:x"}}]}
    with pytest.raises(SandboxClientError, match=r"not supported.*aws"):
        client.create_sandbox(proxy_config=aws)


def test_errors_the_sdk_maps(client: SandboxClient, daemon: Daemon) -> None:
    with pytest.raises(ResourceNotFoundError):
        client.get_sandbox("nope")
    with pytest.raises(ResourceNotFoundError):
        client.delete_sandbox("nope")
    with pytest.raises(ValidationError):
        client.create_sandbox(name="bad name!")
    with pytest.raises(SandboxOperationError):
        client.get_sandbox("shared").reconnect("no-such-command").result  # noqa: B018
    live = [s for s in cella_sandboxes(daemon) if s["state"] in LIVE]
    boxes = [client.create_sandbox(name=f"q{i}") for i in range(QUOTA - len(live))]
    with pytest.raises(QuotaExceededError, match=f"has {QUOTA} live sandboxes; the limit is"):
        client.create_sandbox(name="one-too-many")  # refused at exactly the 7th of 6
    for box in boxes:
        box.delete()
    client.create_sandbox(name="room-again").delete()  # the control: under it, admitted


def test_commands_over_sse(sb: Sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LANGSMITH_EXPERIMENTAL_FEATURES", "sandbox_sse_exec")
    result = sb.run("echo over sse; printf '\\303\\251' >&2; exit 2")
    assert (result.stdout, result.stderr, result.exit_code) == ("over sse\n", "\u00e9", 2)
    with pytest.raises(CommandTimeoutError):
        sb.run("sleep 30", timeout=2)


def test_the_async_client(daemon: Daemon) -> None:
    async def main() -> tuple[str, bytes, list[str]]:
        async with (
            AsyncSandboxClient(
                api_endpoint=f"{daemon.url}/api/v2/sandboxes", api_key=daemon.admin_key
            ) as client,
            await client.sandbox(name="async-box") as box,
        ):
            await box.write("/tmp/a.txt", "async\n")
            data = await box.read("/tmp/a.txt")
            result = await box.run("cat /tmp/a.txt")
            handle = await box.run("echo 1; echo 2", wait=False)
            chunks = [c.data async for c in handle]
            return result.stdout, data, chunks

    stdout, data, chunks = asyncio.run(main())
    assert stdout == "async\n" and data == b"async\n" and "".join(chunks) == "1\n2\n"


def test_files_written_by_the_sdk_land_in_the_trace(
    client: SandboxClient, sb: Sandbox, admin: Client
) -> None:
    """The same sandbox seen through cella's own API: one service, two surfaces."""
    sb.write("/app/traced.txt", "seen\n")
    [info] = [s for s in admin.list() if s.info.name == "shared"]
    writes = [e.data["path"] for e in info.events(types=["file_write"])]
    assert "/app/traced.txt" in writes


def test_header_injection_with_secrets_the_guest_never_sees(
    client: SandboxClient, web: dict[str, object], admin: Client
) -> None:
    token = "ghp_s3cretTOKEN_5e1d"
    admin.put_secret("GH_TOKEN", token, ["web.test"])  # a workspace secret
    rule = {
        "name": "gh",
        "match_hosts": ["web.test"],
        "headers": [
            {"name": "Authorization", "type": "workspace_secret", "value": "Bearer {GH_TOKEN}"},
            {"name": "X-Opaque", "type": "opaque", "value": "op-4ac1-secret-value"},
            {"name": "X-Team", "type": "plaintext", "value": "agents"},
        ],
    }
    config = {"rules": [rule], "access_control": {"allow_list": ["web.test", "other.test"]}}
    seen = web["seen"]
    assert isinstance(seen, Recorder)
    with client.sandbox(name="creds", proxy_config=config) as box:
        before = len(seen.requests)
        out = box.run("curl -sS -H 'Authorization: a guess' http://web.test/h").stdout
        got = seen.requests[before]["headers"]
        assert got["authorization"] == f"Bearer {token}"
        assert got["x-opaque"] == "op-4ac1-secret-value" and got["x-team"] == "agents"
        # the server echoed them; the guest reads them redacted, and has them nowhere
        assert token not in out and "op-4ac1-secret-value" not in out
        assert "[secret:GH_TOKEN]" in out
        where = box.run("env; cat /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n'; true").stdout
        assert token not in where
        other_seen = web["other_seen"]
        assert isinstance(other_seen, Recorder)
        before = len(other_seen.requests)
        other = box.run("curl -sS http://other.test/o").stdout  # other hosts get nothing
        [arrived] = other_seen.requests[before:]  # as the other server saw it
        assert arrived["path"] == "/o"
        assert not {"authorization", "x-opaque", "x-team"} & set(arrived["headers"])
        assert "op-4ac1-secret-value" not in json.dumps(arrived) and token not in other


def cella_sandboxes(d: Daemon) -> list[dict[str, Any]]:
    """The admin tenant's sandboxes as cella's own API shows them (exact states)."""
    got = httpx.get(f"{d.url}/v1/sandboxes", headers={"Authorization": f"Bearer {d.admin_key}"})
    got.raise_for_status()
    return list(got.json()["sandboxes"])


def state_of(d: Daemon, sandbox_id: str) -> str:
    auth = {"Authorization": f"Bearer {d.admin_key}"}
    got = httpx.get(f"{d.url}/v1/sandboxes/{sandbox_id}", headers=auth)
    got.raise_for_status()
    return str(got.json()["state"])


def wait_for_state(d: Daemon, sandbox_id: str, state: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while (now := state_of(d, sandbox_id)) != state:
        assert time.monotonic() < deadline, f"{sandbox_id} is {now}, not {state}"
        time.sleep(0.1)


def test_a_read_only_key_does_not_wake_a_stopped_sandbox(
    client: SandboxClient, daemon: Daemon, admin: Client
) -> None:
    """Waking commits RAM and a quota slot: a write, even through a data-plane GET."""
    read_only = admin.create_key("admin", read_only=True)["key"]
    with client.sandbox(name="asleep") as box:
        assert box.id
        box.write("/tmp/note.txt", "zzz")
        box.stop()
        wait_for_state(daemon, box.id, "stopped")
        url = f"{box.dataplane_url}/download"
        for method in ("GET", "HEAD"):
            got = httpx.request(
                method, url, params={"path": "/tmp/note.txt"}, headers={"X-Api-Key": read_only}
            )
            assert got.status_code == 403, (method, got.status_code, got.text)
        refused = httpx.get(url, params={"path": "/x"}, headers={"X-Api-Key": read_only})
        assert refused.json()["detail"]["error"] == "Forbidden"
        assert "read-only" in refused.json()["detail"]["message"]
        assert state_of(daemon, box.id) == "stopped"  # it sleeps on
        # the control: a read-write key's same GET wakes it and reads the file
        woken = httpx.get(
            url,
            params={"path": "/tmp/note.txt"},
            headers={"X-Api-Key": daemon.admin_key},
            timeout=120,
        )
        assert (woken.status_code, woken.content) == (200, b"zzz")
        assert state_of(daemon, box.id) == "running"
        # and a read-only key reads a running sandbox: nothing to wake
        read = httpx.get(url, params={"path": "/tmp/note.txt"}, headers={"X-Api-Key": read_only})
        assert (read.status_code, read.content) == (200, b"zzz")


def test_updates_are_held_to_the_bounds_of_a_create(client: SandboxClient, daemon: Daemon) -> None:
    client.create_sandbox(name="upd", idle_ttl_seconds=600, delete_after_stop_seconds=3600)
    try:
        with pytest.raises(ValidationError, match="name"):
            client.update_sandbox("upd", new_name="bad name!")  # /v1's pattern refuses it
        with pytest.raises(ValidationError, match="idle_ttl_seconds"):
            client.update_sandbox("upd", idle_ttl_seconds=60 * 10**10)
        with pytest.raises(ValidationError, match="delete_after_stop_seconds"):
            client.update_sandbox("upd", delete_after_stop_seconds=60 * 10**10)
        # what the SDK would not send
        url = f"{daemon.url}/api/v2/sandboxes/boxes/upd"
        headers = {"X-Api-Key": daemon.admin_key, "Content-Type": "application/json"}
        for raw in (
            '{"idle_ttl_seconds": -60}',
            '{"idle_ttl_seconds": NaN}',
            '{"idle_ttl_seconds": 1e400}',
            '{"idle_ttl_seconds": "soon"}',
            '{"delete_after_stop_seconds": 1e20}',
            '{"delete_after_stop_seconds": 90.5}',
            '{"name": "a/b"}',
            '{"name": "' + "n" * 129 + '"}',
            '{"run_config": {"user": "' + "u" * 65 + '"}}',
            '{"run_config": {"env_vars": "X=1"}}',
            '{"idle_ttl_seconds": 120, "name": "no good"}',  # one bad field: nothing changes
        ):
            got = httpx.patch(url, content=raw, headers=headers)
            assert got.status_code == 422, (raw, got.status_code, got.text)
            [problem] = got.json()["detail"]
            assert problem["msg"], raw
        box = client.get_sandbox("upd")
        assert (box.name, box.idle_ttl_seconds, box.delete_after_stop_seconds) == ("upd", 600, 3600)
        # the controls: the largest values a create takes, and a name /v1 takes
        box = client.update_sandbox(
            "upd",
            new_name="upd.v2_ok-1",
            idle_ttl_seconds=30 * 86400,
            delete_after_stop_seconds=365 * 86400,
        )
        assert (box.name, box.idle_ttl_seconds, box.delete_after_stop_seconds) == (
            "upd.v2_ok-1",
            30 * 86400,
            365 * 86400,
        )
    finally:
        for name in ("upd", "upd.v2_ok-1"):
            with contextlib.suppress(ResourceNotFoundError):
                client.delete_sandbox(name)


# -- what the daemon keeps of command sessions ------------------------------------------------


@pytest.fixture(scope="module")
def bounded(module_daemon_factory: DaemonFactory) -> Daemon:
    """Keeps few sessions and little output: 4 per sandbox and 6 per tenant; 2 MiB per
    sandbox and 3 MiB per tenant."""
    return module_daemon_factory(
        "langsmith-bounded",
        pool_size="0",
        max_processes_per_sandbox="4",
        max_processes_per_tenant="6",
        max_process_output_mib_per_sandbox="2",
        max_process_output_mib_per_tenant="3",
    )


def printing(n: int) -> str:
    return f"head -c {n} /dev/zero | tr '\\0' x"


def session(box: Sandbox, n: int) -> str:
    """A session that prints `n` bytes, kept "forever" (ttl -1); its command id."""
    handle = box.run(printing(n), wait=False, ttl_seconds=-1)
    assert handle.result.exit_code == 0 and len(handle.result.stdout) == n
    assert handle.command_id
    return handle.command_id


def kept_output(box: Sandbox, command_id: str) -> int:
    """Bytes of a session's output the daemon still has, read by re-attaching from the
    start (0: the session is gone)."""
    try:
        return len(box.reconnect(command_id).result.stdout)
    except SandboxOperationError as exc:
        assert exc.error_type == "CommandNotFound"
        return 0


def listed(d: Daemon, box: Sandbox) -> list[dict[str, Any]]:
    """The sandbox's processes as cella's own API lists them."""
    auth = {"Authorization": f"Bearer {d.admin_key}"}
    got = httpx.get(f"{d.url}/v1/sandboxes/{box.id}/processes", headers=auth)
    got.raise_for_status()
    return list(got.json()["processes"])


def rss_mib(d: Daemon) -> float:
    assert d.proc is not None
    status = Path(f"/proc/{d.proc.pid}/status").read_text()
    [line] = [ln for ln in status.splitlines() if ln.startswith("VmRSS:")]
    return int(line.split()[1]) / 1024


def test_sessions_kept_forever_stay_within_the_daemon_bounds(bounded: Daemon) -> None:
    api = f"{bounded.url}/api/v2/sandboxes"
    client = SandboxClient(api_endpoint=api, api_key=bounded.admin_key)
    with client.sandbox(name="a") as a, client.sandbox(name="b") as b:
        rss_before = rss_mib(bounded)
        # the control: under every bound, everything is kept
        small = [session(a, MIB // 2) for _ in range(2)]
        assert [kept_output(a, c) for c in small] == [MIB // 2] * 2
        # over the sandbox's bounds: 4 sessions of the 6 are kept, 2 MiB of the 5 MiB
        big = [session(a, MIB) for _ in range(4)]
        assert sum(kept_output(a, c) for c in big) == 2 * MIB
        assert kept_output(a, big[-1]) == MIB  # the newest whole: older output went first
        assert [kept_output(a, c) for c in small] == [0, 0]  # the two longest-ended made room
        shown = listed(bounded, a)
        assert [p["id"] for p in shown] == big
        assert all("stdout" not in p and "stderr" not in p for p in shown)  # no output
        assert sum(p["stdout_bytes"] for p in shown) == 2 * MIB  # the daemon's own count
        # over the tenant's: 6 sessions over both sandboxes, 3 MiB of output
        more = [session(b, MIB) for _ in range(3)]
        both = listed(bounded, a) + listed(bounded, b)
        assert len(both) == 6 and sum(p["stdout_bytes"] for p in both) == 3 * MIB
        assert [p["id"] for p in listed(bounded, b)] == more
        assert kept_output(b, more[-1]) == MIB
        rss_after = rss_mib(bounded)
        print(f"daemon RSS {rss_before:.1f} -> {rss_after:.1f} MiB over 9 MiB of output")
        # the sandbox's sessions all running: a start is refused, with the setting named
        running = [b.run("sleep 600", wait=False, timeout=0) for _ in range(4)]
        assert len(listed(bounded, b)) == 4
        with pytest.raises(SandboxOperationError, match="max_processes_per_sandbox") as refused:
            b.run("sleep 600", wait=False, timeout=0)
        assert refused.value.error_type == "QuotaExceeded"
        running[0].kill()
        deadline = time.monotonic() + 30
        while all(p["running"] for p in listed(bounded, b)):
            assert time.monotonic() < deadline, "the killed session did not end"
            time.sleep(0.1)
        assert b.run("echo room", timeout=60).stdout == "room\n"  # the control: one ended
