"""E2B's lifecycle and network items that need no VM: lifetimes that paused time does not
spend, `autoPause`/`autoPauseMemory`/`autoResume` as a create holds them, fork counts,
`maskRequestHost`, `iam` tokens and `egressProxy` as cella's network policy, the workload
token a verifier checks against the JWKS, and the upstream proxy dialer against real
proxies on loopback (through the real app, fake runtime, where an API is involved)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx2
import jwt
import pytest

from cella import errors
from cella.models import NetworkPolicy, SandboxState
from cella.network.callbacks import Signing
from cella.network.upstream import Splicer, Upstream, UpstreamError, dial
from cella.server.compat.e2b.control import lifecycle_of, network_of
from cella.service.reaper import due
from cella.service.signing import Signer
from cella.store import SandboxRecord
from tests.netservers import UpstreamProxy
from tests.unit.in_process import serving

S = SandboxState


def record(
    state: S, held: float = 0.0, holding: float | None = None, **fields: Any
) -> SandboxRecord:
    now = datetime.now(UTC)
    since = (now - timedelta(seconds=holding)).isoformat() if holding is not None else None
    return SandboxRecord(
        id="sb-1",
        tenant="t",
        state=state,
        template="default",
        vcpus=1,
        memory_mib=512,
        created_at=(now - timedelta(seconds=100)).isoformat(),
        held_seconds=held,
        held_since=since,
        **fields,
    )


def test_a_running_clock_leaves_paused_time_out() -> None:
    now = time.time()
    busy = lambda _: False  # noqa: E731
    # 100 s old, 50 of them paused, a 60 s lifetime: 10 s left (the wall clock: spent)
    running = record(S.running, held=50, ttl_seconds=60, ttl_clock="running")
    wall = record(S.running, held=50, ttl_seconds=60)
    assert due([running], now, busy) == []
    assert [e.action for e in due([wall], now, busy)] == ["delete"]
    assert 49 <= running.age_seconds(now) <= 51
    ends = running.ends_at(now)
    assert ends is not None and 9 <= ends - now <= 11
    # paused for 80 s now, after 20 s of running: its lifetime waits with it
    paused = record(S.paused, holding=80, ttl_seconds=30, ttl_clock="running", ttl_action="stop")
    assert due([paused], now, busy) == [] and 19 <= paused.age_seconds(now) <= 21
    spent = record(S.running, held=10, ttl_seconds=60, ttl_clock="running")
    assert [e.limit for e in due([spent], now, busy)] == ["ttl"]  # the control: 90 s ran


def test_lifecycle_of_an_e2b_create() -> None:
    assert lifecycle_of({}) == {"ttl_action": "delete", "auto_resume": False}
    assert lifecycle_of({"autoPause": True}) == {"ttl_action": "pause", "auto_resume": False}
    assert lifecycle_of({"autoPause": True, "autoPauseMemory": False})["ttl_action"] == "stop"
    woken = lifecycle_of({"autoPause": True, "autoResume": {"enabled": True}})
    assert woken == {"ttl_action": "pause", "auto_resume": True}
    for bad, why in (
        ({"autoResume": {"enabled": True}}, "needs autoPause"),
        (
            {"autoPause": True, "autoPauseMemory": False, "autoResume": {"enabled": True}},
            "filesystem-only",
        ),
        ({"autoResume": True}, "autoResume must be"),
        ({"autoPause": "yes"}, "booleans"),
    ):
        with pytest.raises(errors.InvalidArgument, match=why):
            lifecycle_of(bad)


def test_network_of_maps_mask_iam_and_identity_references() -> None:
    body = {
        "network": {
            "allowOut": ["api.example.com"],
            "maskRequestHost": "${PORT}-app.example.com",
            "rules": {
                "api.example.com": [
                    {
                        "transform": {
                            "headers": {"Authorization": "Bearer ${e2b.identity.tokens.aws}"}
                        }
                    }
                ]
            },
        },
        "iam": {"tokens": {"aws": {"audience": "sts.amazonaws.com", "tokenType": "JWT-SVID"}}},
    }
    net = network_of(body)
    assert net.port_host == "${PORT}-app.example.com"
    assert net.host_for(8000) == "8000-app.example.com"
    assert net.identity_tokens["aws"].audience == "sts.amazonaws.com"
    assert net.headers[0].value == "Bearer {identity:aws}" and net.headers[0].identities == ["aws"]
    # an update carries no iam, mask or public ports: they are kept
    update = {"allowOut": ["api.example.com"], "rules": body["network"]["rules"]}
    assert network_of(update, net).identity_tokens == net.identity_tokens
    assert network_of(update, net).port_host == net.port_host
    assert NetworkPolicy().host_for(3000) == "127.0.0.1:3000"  # the control: no mask
    with pytest.raises(errors.InvalidArgument, match="not among identity_tokens"):
        network_of({**body, "iam": {"tokens": {}}})
    with pytest.raises(errors.InvalidArgument, match="JWT-SVID"):
        network_of({**body, "iam": {"tokens": {"aws": {"audience": "x", "tokenType": "OIDC"}}}})


def test_a_workload_token_verifies_against_the_jwks_for_its_audience(tmp_path: Path) -> None:
    signer = Signer(tmp_path)
    key = signer.current
    signing = Signing.of({"kid": key.kid, "pem": key.pem(), "issuer": "cella"})
    token = signing.workload("sts.amazonaws.com", "acme", "sb-0123", 300)
    jwk = jwt.PyJWKSet.from_dict(signer.jwks())[key.kid]
    claims = jwt.decode(token, jwk, algorithms=["EdDSA"], audience="sts.amazonaws.com")
    assert claims["sub"] == "spiffe://cella/tenant/acme/sandbox/sb-0123"
    assert claims["iss"] == "cella" and 290 <= claims["exp"] - claims["iat"] <= 300
    with pytest.raises(jwt.InvalidAudienceError):  # the control: another audience refuses it
        jwt.decode(token, jwk, algorithms=["EdDSA"], audience="https://other.example.com")


def echo_server() -> tuple[tuple[str, int], socket.socket]:
    """A TCP server on loopback that answers each line with `echo: ` and the line."""
    sock = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            with conn:
                data = conn.recv(1024)
                conn.sendall(b"echo: " + data)

    threading.Thread(target=serve, daemon=True).start()
    return sock.getsockname()[:2], sock


@pytest.mark.parametrize("scheme", ["socks5", "http"])
async def test_dial_through_an_upstream_proxy(scheme: str) -> None:
    (host, port), server = echo_server()
    proxy = UpstreamProxy(("127.0.0.1", 0), scheme, credentials=("alice", "pw"))
    try:
        up = Upstream(scheme, "proxy.test", proxy.address[1], "alice", "pw")
        tunnel = await dial(up, "127.0.0.1", host, port)
        # mitmproxy's side: a loopback address whose one connection is the tunnel
        addr = await Splicer().hand_over(tunnel)
        reader, writer = await asyncio.open_connection(*addr)
        writer.write(b"hello\n")
        assert await asyncio.wait_for(reader.read(100), 10) == b"echo: hello\n"
        writer.close()
        assert proxy.seen.requests == [{"target": f"{host}:{port}", "user": "alice"}]
        # the control: wrong credentials are refused, and nothing is carried
        with pytest.raises(UpstreamError, match=r"refused|credentials"):
            await dial(
                Upstream(scheme, "proxy.test", proxy.address[1], "alice", "no"),
                "127.0.0.1",
                host,
                port,
            )
        assert len(proxy.seen.requests) == 1
    finally:
        proxy.close()
        server.close()


async def test_an_unreachable_upstream_fails_closed() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there
    with pytest.raises(UpstreamError, match="cannot reach"):
        await dial(Upstream("socks5", "gone.test", port), "127.0.0.1", "127.0.0.1", 80)


async def test_e2b_forks_up_to_100_and_pause_keeps_the_lifetime(tmp_path: Path) -> None:
    async with serving(tmp_path) as app:
        transport = httpx2.ASGITransport(app=app.app)
        async with httpx2.AsyncClient(transport=transport, base_url="http://cella.test") as c:
            head = {"X-API-KEY": app.admin_key}
            made = await c.post("/sandboxes", headers=head, json={"timeout": 60, "autoPause": True})
            assert made.status_code == 201, made.text
            sid = made.json()["sandboxID"]
            too_many = await c.post(f"/sandboxes/{sid}/fork", headers=head, json={"count": 101})
            assert too_many.status_code == 400 and "1-100" in too_many.json()["message"]
            row = app.daemon.registry.store.get_sandbox(sid)
            assert row.ttl_clock == "running" and row.ttl_action == "pause"
            paused = await c.post(f"/sandboxes/{sid}/pause", headers=head)
            assert paused.status_code == 204, paused.text
            row = app.daemon.registry.store.get_sandbox(sid)
            assert row.held_since is not None  # its hold began
            # 200 s later (as if): still paused, its lifetime as it was
            later = time.time() + 200
            assert row.age_seconds(later) < 60 and due([row], later, lambda _: False) == []
            info = (await c.get(f"/sandboxes/{sid}", headers=head)).json()
            assert info["lifecycle"] == {"autoResume": False, "onTimeout": "pause"}


def test_an_operators_upstream_for_a_tenant() -> None:
    """`egress_tenant_upstreams`: the operator's proxy for a tenant's sandboxes (credentials
    in the URL), unless a sandbox names its own; a URL that is no proxy is refused."""
    from cella.config import DaemonSettings, upstream_parts
    from cella.models import UpstreamProxy as Rule
    from cella.service.proxy_credentials import upstream

    url = "socks5://corp%40x:p%3Aw@proxy.corp.test:1080"
    assert upstream_parts(url) == {
        "scheme": "socks5",
        "host": "proxy.corp.test",
        "port": 1080,
        "username": "corp@x",
        "password": "p:w",
    }
    settings = DaemonSettings(egress_tenant_upstreams={"acme": url})
    assert settings.egress_tenant_upstreams == {"acme": url}
    for bad in ("ftp://h:1", "socks5://nohost", "http://h:port"):
        with pytest.raises(ValueError, match="not socks5"):
            upstream_parts(bad)
    row = record(S.running)
    got = upstream(None, row, url)  # type: ignore[arg-type]  (no secret is read)
    assert got is not None and got["operator"] is True and got["host"] == "proxy.corp.test"
    assert upstream(None, row, None) is None  # type: ignore[arg-type]
    row.network = NetworkPolicy(upstream_proxy=Rule(url="http://own.test:3128"))
    own = upstream(None, row, url)  # type: ignore[arg-type]
    assert own is not None and own["host"] == "own.test" and "operator" not in own
