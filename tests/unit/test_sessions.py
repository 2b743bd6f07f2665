"""Web console sessions: a signed token naming the key, CSRF tokens derived from it."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from cella import errors
from cella.service.keys import Keys
from cella.service.sessions import Sessions
from cella.store import Store


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    return Keys(Store(tmp_path / "cella.db"))


def test_a_session_speaks_for_its_key_until_the_key_is_revoked(keys: Keys, tmp_path: Path) -> None:
    key_id, key = keys.create("alpha")
    sessions = Sessions(keys, tmp_path / "session.key")
    token, who = sessions.login(key)
    assert key not in token and who.tenant == "alpha"
    assert sessions.principal(token).key_id == key_id
    # the same key file signs for a restarted daemon
    assert Sessions(keys, tmp_path / "session.key").principal(token).tenant == "alpha"
    keys.store.revoke_key(key_id)
    with pytest.raises(errors.Unauthenticated, match="revoked"):
        sessions.principal(token)


def test_bad_keys_and_tampered_or_expired_tokens_are_refused(keys: Keys, tmp_path: Path) -> None:
    _, key = keys.create("alpha")
    other_id, _ = keys.create("beta")
    sessions = Sessions(keys, tmp_path / "session.key")
    with pytest.raises(errors.Unauthenticated):
        sessions.login("ck_unknown")
    token, _ = sessions.login(key)
    key_id, expires, nonce, sig = token.split(".")
    for forged in (
        f"{other_id}.{expires}.{nonce}.{sig}",  # another key's id under this signature
        f"{key_id}.{int(expires) + 3600}.{nonce}.{sig}",  # a longer life
        f"{key_id}.{expires}.{nonce}.{sig[:-2]}AA",
        "not-a-token",
        "",
    ):
        with pytest.raises(errors.Unauthenticated):
            sessions.principal(forged)
    with pytest.raises(errors.Unauthenticated):  # another daemon's key does not sign it
        Sessions(keys, tmp_path / "other.key").principal(token)
    short = Sessions(keys, tmp_path / "session.key", lifetime=-1)
    old, _ = short.login(key)
    time.sleep(0.01)
    with pytest.raises(errors.Unauthenticated, match="expired"):
        sessions.principal(old)


def test_csrf_tokens_belong_to_one_session(keys: Keys, tmp_path: Path) -> None:
    _, key = keys.create("alpha")
    sessions = Sessions(keys, tmp_path / "session.key")
    first, _ = sessions.login(key)
    second, _ = sessions.login(key)
    sessions.check_csrf(first, sessions.csrf_token(first))  # control
    for given in (None, "", sessions.csrf_token(second), "x" * 43):
        with pytest.raises(errors.PermissionDenied):
            sessions.check_csrf(first, given)


def test_a_logged_out_session_stays_out_and_odd_input_is_refused(
    keys: Keys, tmp_path: Path
) -> None:
    _, key = keys.create("alpha")
    sessions = Sessions(keys, tmp_path / "session.key")
    token, _ = sessions.login(key)
    other, _ = sessions.login(key)
    sessions.logout(token)
    with pytest.raises(errors.Unauthenticated, match="logged out"):
        sessions.principal(token)
    assert sessions.principal(other).tenant == "alpha"  # the control: only that one ended
    with pytest.raises(errors.Unauthenticated):
        sessions.principal(other.rpartition(".")[0] + ".ünïcödé\udcff")
    with pytest.raises(errors.PermissionDenied):
        sessions.check_csrf(other, "ünïcödé\ud800")
