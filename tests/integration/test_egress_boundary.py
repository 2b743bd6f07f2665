"""The operator's egress boundary, end to end: a tenant's rules never open the host, its
networks or the fleet's nodes, on every API that sets rules (cella's `/v1`, LangSmith's
`proxy_config`, E2B's `network`), and a rule that slipped into the database anyway is
refused by the proxy at connect. The controls reach the same loopback server through the
operator's two doors: a name in `egress_hosts`, and a network in `egress_tenant_networks`."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx2
import pytest
from langsmith.sandbox import SandboxAuthenticationError, SandboxClient

from cella import Client, Sandbox, errors
from tests.daemon import Daemon, DaemonFactory
from tests.integration.test_e2b import E2B, e2b
from tests.netservers import EchoHandler, Recorder, Servers, free_loopback_block
from tests.sdk_env import sdk_python

pytestmark = pytest.mark.vm
NO_BYPASS = {"no_proxy": "", "NO_PROXY": ""}  # loopback names go to the proxy too


@dataclass
class Net:
    prefix: str
    web: str  # a loopback server the tenant may reach only through the operator
    node: str  # a loopback server at an address the fleet calls a node's
    web_seen: Recorder
    node_seen: Recorder


@pytest.fixture(scope="module")
def net() -> Iterator[Net]:
    prefix = free_loopback_block()
    web, node = f"{prefix}.1", f"{prefix}.5"
    servers = Servers()
    web_seen = servers.start(EchoHandler, (web, 80))
    node_seen = servers.start(EchoHandler, (node, 80))
    yield Net(prefix, web, node, web_seen, node_seen)
    servers.close()


@pytest.fixture(scope="module")
def daemon(net: Net, module_daemon_factory: DaemonFactory) -> Daemon:
    hosts = {"web.test": net.web, "node.test": net.node}
    d = module_daemon_factory("boundary", pool_size="1", egress_hosts=json.dumps(hosts))
    # the fleet gateway's call: this node's sandboxes must not reach the other nodes
    told = httpx2.put(
        f"{d.url}/v1/egress/boundary/fleet",
        json={"addresses": [net.node]},
        headers={"Authorization": f"Bearer {d.admin_key}"},
    )
    assert told.status_code == 200, told.text
    assert net.node in told.json()["protected"]
    return d


@pytest.fixture(scope="module")
def tenant_key(admin: Client) -> str:
    return str(admin.create_key("acme")["key"])


@pytest.fixture(scope="module")
def tenant(daemon: Daemon, tenant_key: str) -> Iterator[Client]:
    with daemon.client(tenant_key) as c:
        yield c


def forbidden_rules(net: Net) -> list[str]:
    """The host's loopback, a server on it, the metadata endpoint, a node, in several forms."""
    return [
        "127.0.0.1",
        f"{net.web}/32:80",
        f"{net.prefix}.0/24",
        "169.254.169.254:80",
        f"{net.node}:80",
        "[::ffff:127.0.0.1]",
        "10.0.0.0/8",
        "localhost",
    ]


def curl(sb: Sandbox, url: str) -> tuple[int, str]:
    r = sb.exec(["curl", "-sS", "-m", "20", "-w", "\n%{http_code}", url], env=NO_BYPASS)
    body, _, code = r.stdout.decode().rpartition("\n")
    return int(code or 0), body


def test_cella_api_refuses_tenant_rules_naming_the_host(
    admin: Client, tenant: Client, net: Net
) -> None:
    for rule in forbidden_rules(net):
        with pytest.raises(errors.DestinationForbidden) as refused:
            tenant.create(allow=[rule])
        assert repr(rule) in str(refused.value), refused.value
        assert "operator" in str(refused.value)
    assert tenant.list() == []  # nothing was made
    # an admin key acting for a tenant is a tenant here
    with pytest.raises(errors.DestinationForbidden):
        admin.create(allow=["169.254.169.254"])
    # control: public destinations and the operator's names are fine
    with tenant.create(allow=["web.test", "0.0.0.0/0", "93.184.216.34", "*.example.com"]) as sb:
        for rule in forbidden_rules(net):
            with pytest.raises(errors.DestinationForbidden, match="egress"):
                sb.set_network(allow=["web.test", rule])
        assert sb.refresh().info.network.allow == [
            "web.test", "0.0.0.0/0", "93.184.216.34", "*.example.com"
        ]  # fmt: skip


def test_langsmith_api_refuses_them(
    daemon: Daemon, tenant_key: str, tenant: Client, net: Net
) -> None:
    ls = SandboxClient(api_endpoint=f"{daemon.url}/api/v2/sandboxes", api_key=tenant_key)
    secrets_before = {s.name for s in tenant.secrets()}
    try:
        for rule in forbidden_rules(net):
            config = {
                "rules": [
                    {"name": "tok", "match_hosts": ["web.test"],
                     "headers": [{"name": "X-Token", "type": "opaque", "value": "v-1"}]}
                ],
                "access_control": {"allow_list": [rule]},
            }  # fmt: skip
            with pytest.raises(SandboxAuthenticationError, match="operator"):
                ls.create_sandbox(proxy_config=config)  # type: ignore[arg-type]
        # the refusal came before the opaque header value was stored as a secret
        assert {s.name for s in tenant.secrets()} == secrets_before
        assert tenant.list() == []
        box = ls.create_sandbox(proxy_config={"access_control": {"allow_list": ["web.test"]}})
        try:
            for rule in (f"{net.web}/32", "169.254.169.254", net.node):
                with pytest.raises(SandboxAuthenticationError, match="operator"):
                    ls.update_sandbox(
                        box.name, proxy_config={"access_control": {"allow_list": [rule]}}
                    )
            assert tenant.get(box.id).info.network.allow == ["web.test"]
        finally:
            ls.delete_sandbox(box.name)
    finally:
        ls.close()


def test_e2b_api_refuses_them(daemon: Daemon, tenant_key: str, tenant: Client, net: Net) -> None:
    python = sdk_python("e2b-2.63.0", E2B)
    got = e2b(
        python,
        daemon,
        f"""
        out = {{}}
        for rule in {forbidden_rules(net)!r}:
            try:
                Sandbox.create(network={{"allow_out": [rule]}})
                out[rule] = "created"
            except Exception as exc:
                out[rule] = type(exc).__name__ + ": " + str(exc)
        sb = Sandbox.create(network={{"allow_out": ["web.test", "93.184.216.34"]}})
        out["control"] = sb.sandbox_id
        print(json.dumps(out))
        """,
        key=tenant_key,
    )
    control = got.pop("control")
    for rule, outcome in got.items():
        assert "operator" in outcome and "created" not in outcome, (rule, outcome)
    assert [s.id for s in tenant.list()] == [control]
    sb = tenant.get(control)
    assert sb.info.network.allow == ["web.test", "93.184.216.34"]
    sb.delete()


def _write_rules(data_dir: Path, sandbox_id: str, allow: list[str]) -> None:
    """What a database from before the boundary may hold."""
    with sqlite3.connect(data_dir / "cella.db") as db:
        (raw,) = db.execute("SELECT network FROM sandboxes WHERE id = ?", (sandbox_id,)).fetchone()
        network = json.loads(raw)
        network["allow"] = allow
        db.execute(
            "UPDATE sandboxes SET network = ? WHERE id = ?", (json.dumps(network), sandbox_id)
        )


def test_old_rules_are_refused_at_connect_and_the_operator_opens_the_same_server(
    daemon: Daemon, tenant: Client, net: Net
) -> None:
    sb = tenant.create(allow=["web.test", "node.test"])
    try:
        api_port = daemon.port
        # rules an older version let a tenant write, written while the daemon is down
        daemon.stop()
        old = [f"{net.web}/32:80", f"{net.node}/32:80", "127.0.0.0/8", "0.0.0.0/0", "::/0", "*"]
        _write_rules(daemon.data_dir, sb.id, ["web.test", "node.test", *old])
        daemon.start()
        assert tenant.get(sb.id).info.network.allow[2:] == old
        web_before, node_before = len(net.web_seen.requests), len(net.node_seen.requests)
        for target in (
            f"http://{net.web}/by-address",
            f"http://{net.node}/by-address",
            f"http://[::ffff:{net.web}]/mapped",
            f"http://localhost:{api_port}/v1/health",  # a name that resolves to loopback
            f"http://127.0.0.1:{api_port}/v1/health",
        ):
            status, body = curl(sb, target)
            assert status == 403 and "cella egress" in body, (target, status, body)
            assert "only the operator opens" in body, (target, body)
        assert len(net.web_seen.requests) == web_before  # nothing reached either server
        assert len(net.node_seen.requests) == node_before
        # control, the same sandbox and probe: the operator's names reach both servers
        status, body = curl(sb, "http://web.test/by-name")
        assert status == 200 and json.loads(body)["path"] == "/by-name"
        assert [r["path"] for r in net.web_seen.requests[web_before:]] == ["/by-name"]
        status, _ = curl(sb, "http://node.test/by-name")
        assert status == 200 and net.node_seen.requests[-1]["path"] == "/by-name"
        denied = [d for d in sb.egress() if not d.allowed]
        assert any(d.host == net.web and "non-public" in d.reason for d in denied)
        assert any(d.host == net.node and "fleet node" in d.reason for d in denied)

        # the operator opens the tenants' loopback block; the fleet's address stays closed
        daemon.stop()
        daemon.settings["egress_tenant_networks"] = json.dumps([f"{net.prefix}.0/24"])
        try:
            daemon.start()
            boundary = httpx2.get(
                f"{daemon.url}/v1/egress/boundary",
                headers={"Authorization": f"Bearer {daemon.admin_key}"},
            ).json()
            assert boundary["tenant_networks"] == [f"{net.prefix}.0/24"]
            assert net.node in boundary["protected"]  # kept across the restart
            sb.set_network(allow=[f"{net.web}/32:80", f"{net.prefix}.0/24"])
            with pytest.raises(errors.DestinationForbidden, match="fleet node"):
                sb.set_network(allow=[f"{net.node}/32"])
            before = len(net.web_seen.requests)
            status, _ = curl(sb, f"http://{net.web}/by-address")
            assert status == 200
            assert [r["path"] for r in net.web_seen.requests[before:]] == ["/by-address"]
            status, body = curl(sb, f"http://{net.node}/by-address")  # inside the /24 rule
            assert status == 403 and "fleet node" in body
        finally:
            daemon.stop()
            daemon.settings.pop("egress_tenant_networks")
            daemon.start()
    finally:
        sb.delete()
