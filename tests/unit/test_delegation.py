"""Access delegation's decisions, in process: the token format, the daemon's check of a
token (fresh, from a live sandbox with a grant, its creator's key still valid) and what the
proxy puts on a request. (End to end, from inside a guest: tests/integration.)"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import httpx2
import pytest

from cella import errors
from cella.config import DaemonSettings
from cella.fleet.delegation import Delegations
from cella.fleet.placement_table import Placements
from cella.fleet.tls import node_certificate
from cella.models import AccessDelegation, SandboxState
from cella.network.delegation import ApiAccess, access_from, authorize, is_api
from cella.policy import delegation as tokens
from cella.policy.access import Role
from cella.service.delegation import (
    FLEET_GRANT,
    given,
    grant,
    grant_for,
    pinned_of,
    proxy_access,
    upstream_of,
)
from cella.service.keys import Keys, Principal
from cella.store import SandboxRecord, Store
from tests.unit.in_process import URL, serving

KEY = bytes(range(32))


def test_tokens_are_minted_for_one_sandbox_and_expire() -> None:
    token = tokens.mint("sb-1", KEY)
    assert token.startswith(tokens.PREFIX) and tokens.sandbox_of(token) == "sb-1"
    assert tokens.valid(token, KEY)
    assert not tokens.valid(token, bytes(32))  # another sandbox's key
    assert not tokens.valid(token, KEY, now=time.time() + tokens.LIFETIME_SECONDS + 1)
    forged = token.replace("sb-1", "sb-2")
    assert tokens.sandbox_of(forged) == "sb-2" and not tokens.valid(forged, KEY)
    assert tokens.sandbox_of("ck_an-api-key") is None


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    return Keys(Store(tmp_path / "cella.db"))


def sandbox(keys: Keys, key_id: str, asked: AccessDelegation | None) -> SandboxRecord:
    granted = grant(asked, Principal("team", False, False, key_id))
    row = SandboxRecord(
        id="sb-1",
        tenant="team",
        state=SandboxState.running,
        template="default",
        vcpus=1,
        memory_mib=512,
        delegation=granted,
    )
    keys.store.insert_sandbox(row)
    return row


def test_a_token_acts_as_the_creator_while_its_key_is_valid(keys: Keys) -> None:
    key_id, _ = keys.create("team", principal="alice", roles=[Role.member])
    row = sandbox(keys, key_id, AccessDelegation(mode="inherit"))
    assert keys.store.get_sandbox(row.id).access_delegation == {  # type: ignore[union-attr]
        "mode": "inherit",
        "permissions": [],
    }
    key = proxy_access(row)
    assert key is not None
    who = keys.authenticate(tokens.mint(row.id, key))
    # its creator's principal and roles: code in the sandbox sees what alice sees
    assert who == Principal("team", False, False, key_id, "alice", frozenset({Role.member}))
    with pytest.raises(errors.Unauthenticated, match="forged"):
        keys.authenticate(tokens.mint(row.id, bytes(32)))
    keys.store.revoke_key(key_id)
    with pytest.raises(errors.Unauthenticated, match="revoked"):
        keys.authenticate(tokens.mint(row.id, key))


def test_explicit_read_reads_only_and_a_gone_sandbox_acts_for_nobody(keys: Keys) -> None:
    key_id, _ = keys.create("team")
    row = sandbox(keys, key_id, AccessDelegation(mode="explicit", permissions=["sandboxes:read"]))
    key = proxy_access(row)
    assert key is not None
    assert keys.authenticate(tokens.mint(row.id, key)).read_only
    keys.store.update_sandbox(row.id, state=SandboxState.deleted)
    with pytest.raises(errors.Unauthenticated, match="not a valid"):
        keys.authenticate(tokens.mint(row.id, key))


def test_a_grant_is_checked_when_asked_for() -> None:
    with pytest.raises(ValueError, match="needs permissions"):
        AccessDelegation(mode="explicit")
    with pytest.raises(ValueError, match="not inherit"):
        AccessDelegation(mode="inherit", permissions=["sandboxes:read"])
    with pytest.raises(ValueError):
        AccessDelegation(mode="explicit", permissions=["everything"])  # type: ignore[list-item]
    with pytest.raises(errors.InvalidArgument, match="own API key"):
        grant(AccessDelegation(mode="inherit"), Principal("team", False, False, None))
    assert grant(None, None) is None


def test_the_proxy_replaces_the_guests_credentials_with_a_fresh_token() -> None:
    api = ApiAccess("sb-1", ("127.0.0.1", 8420), KEY)
    assert is_api(api, "cella.api") and is_api(api, "CELLA.API.") and not is_api(api, "x.api")
    assert not is_api(None, "cella.api")
    headers = {"x-api-key": "the guest's", "authorization": "Bearer guess", "accept": "*/*"}
    authorize(headers, api)
    token = headers["x-api-key"]
    assert tokens.valid(token, KEY) and headers["authorization"] == f"Bearer {token}"
    assert headers["accept"] == "*/*"
    # what the daemon sends the proxy: in clear on this host, or a gateway's pinned TLS
    plain = {"sandbox": "sb-1", "api": {"upstream": ["127.0.0.1", 8420], "key": KEY.hex()}}
    assert access_from(plain) == api and api.pinned is None
    pem = "-----BEGIN CERTIFICATE-----\nTUlJQg==\n-----END CERTIFICATE-----\n"
    over_tls = {"sandbox": "sb-1", "api": {**plain["api"], "tls": pem}}  # type: ignore[dict-item]
    assert access_from(over_tls) == ApiAccess("sb-1", ("127.0.0.1", 8420), KEY, pem)
    assert access_from({"sandbox": "sb-1"}) is None


def test_a_gateways_grant_is_read_whole_or_refused() -> None:
    asked = AccessDelegation(mode="explicit", permissions=["sandboxes:read"])
    made = grant_for(asked, Principal("team", False, False, "key-1"), ("127.0.0.1", 8420))
    header = json.dumps({k: made[k] for k in ("key_id", "key", "upstream")})
    kept = given(asked, header)
    assert kept == made  # the mode and permissions are the create's, the rest the gateway's
    row = SandboxRecord(id="sb-9", tenant="team", state=SandboxState.running,
                        template="default", vcpus=1, memory_mib=512, delegation=kept)  # fmt: skip
    assert upstream_of(row) == ("127.0.0.1", 8420)
    assert (
        upstream_of(replace(row, delegation=grant(asked, Principal("t", False, False, "k"))))
        is None
    )
    with pytest.raises(errors.InvalidArgument, match="without access_delegation"):
        given(None, header)
    for bad in ("", "[]", json.dumps({"key_id": "k", "key": "short", "upstream": ["h", 1]}),
                header.replace("8420", '"8420"')):  # fmt: skip
        with pytest.raises(errors.InvalidArgument, match="not a grant"):
            given(asked, bad)
    assert pinned_of(row) is None  # in clear, on this host
    # a gateway serving TLS sends its certificate; the node keeps it for its proxy to pin
    pem = "-----BEGIN CERTIFICATE-----\nTUlJQg==\n-----END CERTIFICATE-----\n"
    over_tls = grant_for(asked, Principal("team", False, False, "key-1"), ("10.0.0.2", 443), pem)
    sent = json.dumps({k: over_tls[k] for k in ("key_id", "key", "upstream", "tls")})
    kept_tls = given(asked, sent)
    assert kept_tls == over_tls and pinned_of(replace(row, delegation=kept_tls)) == pem
    for not_pem in (7, "", "a certificate", pem + pem, pem.replace("TUlJQg==", "<x>")):
        tampered = json.dumps({**json.loads(sent), "tls": not_pem})
        with pytest.raises(errors.InvalidArgument, match="tls is not one PEM certificate"):
            given(asked, tampered)


def test_a_gateway_checks_tokens_against_the_grants_it_made(tmp_path: Path) -> None:
    placements = Placements(tmp_path / "placements.db")
    store = Store(tmp_path / "gateway.db")
    holder: list[Delegations] = []
    keys = Keys(store, grant_of=lambda sid: holder[0].grant_of(sid))
    settings = DaemonSettings(data_dir=tmp_path, listen="127.0.0.1:8420")
    delegations = Delegations(tmp_path / "grants.db", settings, placements, keys)
    holder.append(delegations)
    _, key = keys.create("team")
    creator = keys.authenticate(key)  # its principal and roles, as a token carries them
    # an admin acting for the tenant is not the tenant's own key
    admin_id, _ = keys.create("admin", admin=True)
    with pytest.raises(errors.InvalidArgument, match="own API key"):
        delegations.ask(Principal("team", False, False, admin_id), AccessDelegation(mode="inherit"))
    assert delegations.ask(creator, None) is None
    made = delegations.ask(creator, AccessDelegation(mode="inherit"))
    assert made is not None and made["upstream"] == ["127.0.0.1", 8420]
    token = tokens.mint("sb-1", bytes.fromhex(str(made["key"])))
    with pytest.raises(errors.Unauthenticated, match="not a valid"):
        keys.authenticate(token)  # not placed yet
    placements.put("n1", {"id": "sb-1", "tenant": "team", "state": "running"})
    delegations.made("sb-1", "team", made)
    assert keys.authenticate(token) == creator
    placements.deleted("sb-1")
    with pytest.raises(errors.Unauthenticated, match="not a valid"):
        keys.authenticate(token)
    # a gateway serving TLS: the grant carries its certificate, which the proxy pins
    cert, key_file = node_certificate(tmp_path / "tls", "127.0.0.1", "gateway")
    chain = cert.read_text() + cert.read_text()  # a chain: the first one is the server's
    (tmp_path / "chain.pem").write_text(chain)
    tls = DaemonSettings(
        data_dir=tmp_path, listen="127.0.0.1:8420", tls_cert=tmp_path / "chain.pem",
        tls_key=key_file,
    )  # fmt: skip
    pinned = Delegations(tmp_path / "g3.db", tls, placements, keys)
    over_tls = pinned.ask(creator, AccessDelegation(mode="inherit"))
    assert over_tls is not None and over_tls["tls"] == cert.read_text()
    sent = json.loads(pinned.header(over_tls)[FLEET_GRANT])
    assert sent["tls"] == cert.read_text() and sent["upstream"] == ["127.0.0.1", 8420]
    assert "tls" not in json.loads(delegations.header(made)[FLEET_GRANT])  # in clear: none
    # a gateway on every address says why it cannot
    everywhere = DaemonSettings(data_dir=tmp_path, listen="0.0.0.0:8420")
    bad = Delegations(tmp_path / "g2.db", everywhere, placements, keys)
    with pytest.raises(errors.InvalidArgument, match=r"listens on 0\.0\.0\.0"):
        bad.ask(creator, AccessDelegation(mode="inherit"))


async def test_a_node_takes_a_grant_only_from_a_gateway(tmp_path: Path) -> None:
    """`X-Cella-Grant` on a node: kept whole (the proxy is sent to the gateway's address)
    from an admin key acting for the tenant; refused from a tenant's own key, nothing made."""
    async with serving(tmp_path) as app:
        _, team_key = app.daemon.keys.create("team")
        asked = AccessDelegation(mode="inherit")
        made = grant_for(asked, Principal("team", False, False, "key-of-the-gateway"),
                         ("127.0.0.9", 8000))  # fmt: skip
        header = {FLEET_GRANT: json.dumps({k: made[k] for k in ("key_id", "key", "upstream")})}
        body = {"access_delegation": {"mode": "inherit"}}
        transport = httpx2.ASGITransport(app=app.app)
        async with httpx2.AsyncClient(transport=transport, base_url=URL) as http:
            own = {"authorization": f"Bearer {team_key}"}
            refused = await http.post("/v1/sandboxes", json=body, headers=own | header)
            assert refused.status_code == 403 and "fleet gateway" in refused.text
            assert app.daemon.store.list_sandboxes("team") == []
            acting = {"authorization": f"Bearer {app.admin_key}", "x-cella-tenant": "team"}
            created = await http.post("/v1/sandboxes", json=body, headers=acting | header)
            assert created.status_code == 201, created.text
            row = app.daemon.store.get_sandbox(created.json()["id"])
            assert row is not None and row.delegation == made
            assert upstream_of(row) == ("127.0.0.9", 8000)
            # without the header, an admin acting for the tenant is refused as ever
            bare = await http.post("/v1/sandboxes", json=body, headers=acting)
            assert bare.status_code == 400 and "own API key" in bare.text
