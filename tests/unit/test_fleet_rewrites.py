"""Rewrites on a fleet, the parts that need no VM: the link a node is given (and refuses
when it is not one), what the gateway keeps of a rule and how it checks a node's request
(the token of the sandbox's node, the rule as set, its setter's key still valid), and the
credentials a relayed rewrite carries. (End to end across nodes: tests/fleet.)"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx2
import pytest

from cella import errors
from cella.config import DaemonSettings
from cella.fleet.delegation import Delegations
from cella.fleet.locator import Locator
from cella.fleet.placement_table import Placements
from cella.fleet.rewrites import FleetRewrites
from cella.fleet.tls import node_certificate
from cella.models import RewriteRule, SandboxPort
from cella.policy.access import Role
from cella.policy.delegation import mint
from cella.policy.rewrites import FLEET_REWRITE
from cella.service.keys import Keys, Principal
from cella.service.rewrites import FleetLink, Rewrites
from cella.store import Store
from tests.unit.in_process import URL, serving


@pytest.fixture
def gateway(tmp_path: Path) -> tuple[FleetRewrites, Keys, Placements]:
    placements = Placements(tmp_path / "placements.db")
    keys = Keys(Store(tmp_path / "gateway.db"))
    nodes = {"n1": SimpleNamespace(name="n1"), "n2": SimpleNamespace(name="n2")}
    membership: Any = SimpleNamespace(up=nodes.get)
    cert, key = node_certificate(tmp_path / "tls", "127.0.0.1", "gateway")
    settings = DaemonSettings(
        data_dir=tmp_path, listen="127.0.0.1:8420", tls_cert=cert, tls_key=key
    )
    delegations = Delegations(tmp_path / "grants.db", settings, placements, keys)
    rewrites = FleetRewrites(
        tmp_path / "rewrites.db",
        tmp_path / "rewrites.key",
        Locator(membership, placements),
        keys,
        delegations,
    )
    return rewrites, keys, placements


def test_a_node_is_linked_to_the_gateway_it_trusts_alone(
    gateway: tuple[FleetRewrites, Keys, Placements], tmp_path: Path
) -> None:
    rewrites, _, _ = gateway
    given = rewrites.link("n1")
    assert given is not None and given["url"] == "https://127.0.0.1:8420"
    assert given["tls"] == (tmp_path / "tls" / "node.crt").read_text()
    link = FleetLink.of(given)
    assert link.to_json() == given and link.context() is not None
    assert rewrites.link("n2") != given  # a key of each node's own
    plain = FleetLink.of({"url": "http://127.0.0.1:8420", "key": "ab" * 32, "tls": None})
    assert plain.context() is None
    for bad in (
        {},
        {"url": "ftp://x", "key": "ab" * 32},
        {"url": "http://x", "key": "ab"},
        {"url": "https://x", "key": "ab" * 32},  # https without its certificate
        {"url": "http://x", "key": "zz" * 32},
        {**given, "tls": "not a certificate"},
    ):
        with pytest.raises(errors.InvalidArgument):
            FleetLink.of(bad)


def test_the_gateway_checks_a_nodes_request_against_the_rule_and_its_setter(
    gateway: tuple[FleetRewrites, Keys, Placements],
) -> None:
    rewrites, keys, placements = gateway
    placements.put("n1", {"id": "sb-a", "tenant": "acme", "state": "running"})
    placements.put("n2", {"id": "sb-b", "tenant": "acme", "state": "running"})
    key_id, key = keys.create("acme", principal="bob", roles=[Role.member])
    bob = keys.authenticate(key)
    network = {"rewrites": [{"host": "svc.internal", "to": {"sandbox": "sb-b", "port": 8000}}]}
    rewrites.record("sb-a", bob, network)
    node_key = bytes.fromhex(str((rewrites.link("n1") or {})["key"]))
    kept, node = rewrites.check("sb-a", "SVC.internal", mint("sb-a", node_key))
    assert (kept.target, kept.port, kept.setter, node.name) == ("sb-b", 8000, bob, "n2")
    # another node's token, another sandbox's, no rule for the host: refused
    other = bytes.fromhex(str((rewrites.link("n2") or {})["key"]))
    with pytest.raises(errors.PermissionDenied, match="rewrite token"):
        rewrites.check("sb-a", "svc.internal", mint("sb-a", other))
    with pytest.raises(errors.PermissionDenied, match="rewrite token"):
        rewrites.check("sb-a", "svc.internal", mint("sb-b", node_key))
    with pytest.raises(errors.NotFound, match=r"no rewrite for other\.internal"):
        rewrites.check("sb-a", "other.internal", mint("sb-a", node_key))
    # the target gone: unavailable; then the setter's key revoked: refused
    placements.deleted("sb-b")
    with pytest.raises(errors.SandboxUnavailable, match="no longer exists"):
        rewrites.check("sb-a", "svc.internal", mint("sb-a", node_key))
    placements.put("n2", {"id": "sb-b", "tenant": "acme", "state": "running"})
    # a fork (on n1, another on n2) inherits the rule with its setter; a sandbox that is no
    # fork of it has none
    placements.put("n1", {"id": "sb-c", "tenant": "acme", "state": "running"})
    placements.put("n2", {"id": "sb-d", "tenant": "acme", "state": "running"})
    rewrites.inherit("sb-c", "sb-a")
    rewrites.inherit("sb-d", "sb-d-parent-without-rules")
    kept, node = rewrites.check("sb-c", "svc.internal", mint("sb-c", node_key))
    assert (kept.target, kept.port, kept.setter, node.name) == ("sb-b", 8000, bob, "n2")
    with pytest.raises(errors.NotFound, match="no rewrite"):
        rewrites.check("sb-d", "svc.internal", mint("sb-d", other))
    keys.revoke(Principal("admin", True), key_id)
    for box in ("sb-a", "sb-c"):  # revoked: refused in the sandbox and in its fork
        with pytest.raises(errors.PermissionDenied, match="revoked"):
            rewrites.check(box, "svc.internal", mint(box, node_key))
    # rules set anew replace the old ones
    rewrites.record("sb-a", bob, {"rewrites": []})
    with pytest.raises(errors.NotFound):
        rewrites.check("sb-a", "svc.internal", mint("sb-a", node_key))


async def test_a_gateway_on_every_address_links_no_node(tmp_path: Path) -> None:
    placements = Placements(tmp_path / "p.db")
    keys = Keys(Store(tmp_path / "g.db"))
    everywhere = DaemonSettings(data_dir=tmp_path, listen="0.0.0.0:8420")
    rewrites = FleetRewrites(
        tmp_path / "r.db",
        tmp_path / "r.key",
        Locator(SimpleNamespace(up=lambda _: None), placements),  # type: ignore[arg-type]
        keys,
        Delegations(tmp_path / "d.db", everywhere, placements, keys),
    )
    assert rewrites.link("n1") is None
    who = Principal("acme", False)
    assert await rewrites.settle(who, {"allow": ["pypi.org"]}) == {"allow": ["pypi.org"]}
    rule = {"host": "svc.internal", "to": {"sandbox": "sb-b", "port": 8000}}
    with pytest.raises(
        errors.InvalidArgument, match=r"rewrites: the gateway listens on 0\.0\.0\.0"
    ):
        await rewrites.settle(who, {"rewrites": [rule]})
    with pytest.raises(errors.InvalidArgument, match=r"port"):
        await rewrites.settle(who, {"rewrites": [{**rule, "to": {"sandbox": "x", "port": 0}}]})


async def test_a_node_takes_its_link_and_deliveries_from_its_gateway_alone(
    tmp_path: Path,
) -> None:
    """`PUT /v1/fleet/link` and the delivery door answer an admin key only (the delivery
    also needs the gateway's own header); once linked, a rule may name a sandbox that is
    not on this node (the gateway settled it), where an unlinked daemon refuses it."""
    (tmp_path / "egress").mkdir()
    (tmp_path / "egress" / "mitmproxy-ca-cert.pem").write_text("the deployment's CA\n")
    async with serving(tmp_path) as app:
        _, team_key = app.daemon.keys.create("team")
        transport = httpx2.ASGITransport(app=app.app)
        admin = {"authorization": f"Bearer {app.admin_key}"}
        team = {"authorization": f"Bearer {team_key}"}
        link = {"url": "http://127.0.0.1:8420", "key": "ab" * 32, "tls": None}
        async with httpx2.AsyncClient(transport=transport, base_url=URL) as http:
            async with app.client(team_key) as client:
                box = await client.create(name="caller")
                rule = RewriteRule(host="svc.internal", to=SandboxPort(sandbox="sb-x", port=80))
                with pytest.raises(errors.InvalidArgument, match="may exec in"):
                    await box.set_network(rewrites=[rule])  # unlinked: no such sandbox here
                refused = await http.put("/v1/fleet/link", json=link, headers=team)
                assert refused.status_code == 403 and app.daemon.rewrites.link is None
                linked = await http.put("/v1/fleet/link", json=link, headers=admin)
                assert linked.status_code == 204, linked.text
                kept = tmp_path / "fleet-link.json"
                assert json.loads(kept.read_text()) == link and kept.stat().st_mode & 0o077 == 0
                await box.set_network(rewrites=[rule])  # the control: linked, it is kept
                assert box.info.network.rewrites[0].to.sandbox == "sb-x"
                door = f"/v1/fleet/rewrites/{box.id}/8000/page.txt"
                acting = admin | {"x-cella-tenant": "team"}
                for headers in (team, team | {FLEET_REWRITE: "sb-a"}, acting):
                    got = await http.get(door, headers=headers)
                    assert got.status_code == 403 and "fleet gateway" in got.text, got.text
            # a restarted daemon keeps its link
            assert Rewrites(app.daemon.registry, app.daemon.ports, app.daemon.keys, tls=False,
                            link_file=kept).link == FleetLink.of(link)  # fmt: skip
