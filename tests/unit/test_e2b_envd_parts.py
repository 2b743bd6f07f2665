"""The pure parts of E2B's envd as cella serves it: file URL signatures as the pinned SDK
makes them, metadata headers held to envd's bounds, watch events with and without their
entries, and keys in the form E2B's SDKs check."""

from __future__ import annotations

import base64
import hashlib
import re
from pathlib import Path
from typing import Any

import pytest
from starlette.requests import Request

from cella import errors
from cella.guest.protocol import Entry
from cella.server.compat.e2b.files import metadata_of
from cella.server.compat.e2b.target import check_signature, signature
from cella.server.compat.e2b.watch import changes
from cella.service.keys import Keys
from cella.store import Store


def request(query: str = "", headers: dict[str, str] | None = None) -> Request:
    raw = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    scope = {"type": "http", "method": "GET", "path": "/files", "query_string": query.encode()}
    return Request({**scope, "headers": raw})


def sdk_signature(path: str, op: str, user: str, token: str, exp: int | None) -> str:
    """The SDK's `e2b.sandbox.signature.get_signature`, as written there."""
    raw = f"{path}:{op}:{user}:{token}" + (f":{exp}" if exp is not None else "")
    return "v1_" + base64.b64encode(hashlib.sha256(raw.encode()).digest()).rstrip(b"=").decode()


def test_signatures_are_the_sdks() -> None:
    assert signature("t", "/a b", "read", "", None) == sdk_signature("/a b", "read", "", "t", None)
    assert signature("t", "x", "write", "u", 9) == sdk_signature("x", "write", "u", "t", 9)


def test_a_signed_url_is_checked_for_its_path_operation_and_expiry() -> None:
    good = signature("tok", "/home/user/a.txt", "read", "", 4_000_000_000)
    query = f"path=/home/user/a.txt&signature={good}&signature_expiration=4000000000"
    check_signature("tok", "read", request(query))  # the control: it passes
    with pytest.raises(errors.Unauthenticated, match="invalid signature"):
        check_signature("tok", "write", request(query))  # another operation
    with pytest.raises(errors.Unauthenticated, match="invalid signature"):
        check_signature("other", "read", request(query))  # another sandbox's token
    other = query.replace("a.txt", "b.txt", 1)
    with pytest.raises(errors.Unauthenticated, match="invalid signature"):
        check_signature("tok", "read", request(other))  # another path
    old = signature("tok", "/home/user/a.txt", "read", "", 1000)
    expired = f"path=/home/user/a.txt&signature={old}&signature_expiration=1000"
    with pytest.raises(errors.Unauthenticated, match="expired"):
        check_signature("tok", "read", request(expired))
    with pytest.raises(errors.Unauthenticated):
        check_signature("tok", "read", request("path=/home/user/a.txt"))  # none at all


def test_metadata_headers() -> None:
    got = metadata_of(request(headers={"X-Metadata-Owner": "Red", "Content-Type": "text/x"}))
    assert got == {"owner": "Red"}  # keys lower-cased, values kept, other headers ignored
    assert metadata_of(request()) == {}
    with pytest.raises(errors.InvalidArgument, match="246"):
        metadata_of(request(headers={"X-Metadata-" + "k" * 247: "v"}))
    with pytest.raises(errors.InvalidArgument, match="4096"):
        metadata_of(request(headers={f"X-Metadata-k{i}": "v" * 200 for i in range(30)}))


def entry(name: str, size: int, kind: str = "file") -> Entry:
    return Entry(name, kind, 0o644, size, 1, 0, 0)


def test_watch_events_carry_entries_when_asked() -> None:
    before = {"a": entry("a", 1), "gone": entry("gone", 1)}
    after = {"a": entry("a", 2), "d": entry("d", 0, "dir"), "d/new": entry("new", 3)}

    def shown(e: Entry, path: str) -> dict[str, Any]:
        return {"path": path, "size": e.size}

    plain = changes(before, after)
    assert [(e["name"], e["type"]) for e in plain] == [
        ("d", "EVENT_TYPE_CREATE"),
        ("d/new", "EVENT_TYPE_CREATE"),
        ("a", "EVENT_TYPE_WRITE"),
        ("gone", "EVENT_TYPE_REMOVE"),
    ]
    assert all("entry" not in e for e in plain)
    rich = {e["name"]: e.get("entry") for e in changes(before, after, "/w", shown)}
    assert rich["d/new"] == {"path": "/w/d/new", "size": 3}
    assert rich["a"] == {"path": "/w/a", "size": 2}
    assert rich["gone"] is None  # a removal never carries one


def test_e2b_form_keys(tmp_path: Path) -> None:
    keys = Keys(Store(tmp_path / "db.sqlite"))
    _, e2b_key = keys.create("alice", form="e2b")
    _, own_key = keys.create("alice")
    assert re.fullmatch(r"e2b_[0-9a-f]+", e2b_key)  # the 2.45.x SDKs' check
    assert not re.fullmatch(r"e2b_[0-9a-f]+", own_key)  # the control: cella's own is not
    assert keys.authenticate(e2b_key).tenant == keys.authenticate(own_key).tenant == "alice"
