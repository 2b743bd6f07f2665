"""Access delegation's decisions, in process: the token format, the daemon's check of a
token (fresh, from a live sandbox with a grant, its creator's key still valid) and what the
proxy puts on a request. (End to end, from inside a guest: tests/integration.)"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from cella import errors
from cella.models import AccessDelegation, SandboxState
from cella.network.delegation import ApiAccess, authorize, is_api
from cella.policy import delegation as tokens
from cella.policy.access import Role
from cella.service.delegation import grant, proxy_access
from cella.service.keys import Keys, Principal
from cella.store import SandboxRecord, Store

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
