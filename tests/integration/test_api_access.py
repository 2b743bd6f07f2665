"""Tenants, keys and bad input against a real daemon: clear 4xx errors and nothing changes."""

from __future__ import annotations

from collections.abc import Iterator

import httpx2
import pytest

from cella import Client, Sandbox, errors
from tests.daemon import Daemon

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def alice(admin: Client, daemon: Daemon) -> Iterator[Client]:
    with daemon.client(admin.create_key("alice")["key"]) as client:
        yield client


@pytest.fixture(scope="module")
def bob(admin: Client, daemon: Daemon) -> Iterator[Client]:
    with daemon.client(admin.create_key("bob")["key"]) as client:
        yield client


def test_tenants_see_only_their_own_sandboxes(admin: Client, alice: Client, bob: Client) -> None:
    with alice.create(labels={"owner": "alice"}) as sb:
        assert [s.id for s in alice.list()] == [sb.id]
        assert sb.id not in [s.id for s in bob.list()]
        with pytest.raises(errors.NotFound):
            bob.get(sb.id)
        # bob's key aimed straight at alice's sandbox: each call is really sent
        as_bob = Sandbox(bob, sb.info)
        for attempt in (
            lambda: as_bob.exec("touch /tmp/bob-was-here"),
            lambda: as_bob.files.write("/tmp/bob-was-here", "x"),
        ):
            with pytest.raises(errors.NotFound):
                attempt()
        # bob cannot act on it through the raw API either, and gets the same answer
        for method, path in (
            ("POST", "/stop"),
            ("DELETE", ""),
            ("GET", "/events"),
            ("GET", "/files/content?path=/etc/hostname"),
        ):
            with pytest.raises(errors.NotFound):
                bob.request(method, f"/v1/sandboxes/{sb.id}{path}")
        # the exec reached the daemon and was refused there; nothing ran
        bobs = {(u.method, u.path, u.status) for u in admin.key_uses(tenant="bob")}
        assert ("POST", f"/v1/sandboxes/{sb.id}/exec", 404) in bobs
        assert not sb.files.exists("/tmp/bob-was-here")
        # control: the same call with alice's key runs
        assert Sandbox(alice, sb.info).exec("touch /tmp/alice-was-here").exit_code == 0
        assert sb.files.exists("/tmp/alice-was-here")
        assert alice.get(sb.id).state == "running"
    with pytest.raises(errors.Forbidden):
        alice.create_key("mallory")


def test_an_admin_key_acts_for_a_tenant(
    admin: Client, alice: Client, bob: Client, daemon: Daemon
) -> None:
    """X-Cella-Tenant (what a fleet gateway sends): an admin key acts as that tenant and only
    sees what it owns; a tenant's key cannot use it."""
    as_alice = httpx2.Client(
        base_url=daemon.url,
        headers={"Authorization": f"Bearer {daemon.admin_key}", "X-Cella-Tenant": "alice"},
        timeout=60,
    )
    with as_alice, admin.create() as admins_own:
        made = as_alice.post("/v1/sandboxes", json={}).json()
        try:
            assert made["id"] in [s.id for s in alice.list()]  # alice owns it
            listed = [s["id"] for s in as_alice.get("/v1/sandboxes").json()["sandboxes"]]
            assert listed == [made["id"]]  # not the admin's own sandbox
            assert as_alice.get(f"/v1/sandboxes/{admins_own.id}").status_code == 404
            r = as_alice.post("/v1/keys", json={"tenant": "mallory"})
            assert r.status_code == 403  # acting as a tenant drops the admin's rights
        finally:
            alice.get(made["id"]).delete()
    r = httpx2.get(
        f"{daemon.url}/v1/sandboxes",
        headers={"Authorization": f"Bearer {bob.api_key}", "X-Cella-Tenant": "alice"},
    )
    assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied"
    r = httpx2.get(
        f"{daemon.url}/v1/sandboxes",
        headers={"Authorization": f"Bearer {daemon.admin_key}", "X-Cella-Tenant": "../x"},
    )
    assert r.status_code == 400


def test_an_admin_key_acting_read_only_only_reads(alice: Client, daemon: Daemon) -> None:
    """X-Cella-Read-Only beside X-Cella-Tenant (a fleet gateway relaying a read-only key):
    the node holds the call to reads, as it would the tenant's read-only key."""
    headers = {
        "Authorization": f"Bearer {daemon.admin_key}",
        "X-Cella-Tenant": "alice",
        "X-Cella-Read-Only": "1",
    }
    with httpx2.Client(base_url=daemon.url, headers=headers, timeout=60) as reader:
        before = [s.id for s in alice.list()]
        refused = reader.post("/v1/sandboxes", json={})
        assert refused.status_code == 403, refused.text
        assert "read-only" in refused.json()["error"]["message"]
        assert [s.id for s in alice.list()] == before  # nothing was made
        # control: the same key and tenant read
        listed = reader.get("/v1/sandboxes")
        assert listed.status_code == 200 and [s["id"] for s in listed.json()["sandboxes"]] == before


def test_missing_and_bad_keys_get_401(daemon: Daemon) -> None:
    r = httpx2.get(f"{daemon.url}/v1/sandboxes")
    assert r.status_code == 401 and r.json()["error"]["code"] == "unauthenticated"
    r = httpx2.get(f"{daemon.url}/v1/sandboxes", headers={"Authorization": "Bearer ck_nope"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "unauthenticated"
    r = httpx2.get(f"{daemon.url}/v1/sandboxes", headers={"Authorization": "Basic abc"})
    assert r.status_code == 401


def test_revoked_key_stops_working(admin: Client, daemon: Daemon) -> None:
    created = admin.create_key("temp")
    with daemon.client(created["key"]) as temp:
        assert temp.list() == []
        admin.revoke_key(created["id"])
        with pytest.raises(errors.Unauthenticated):
            temp.list()


NO_EXPORT = {  # a replica this daemon does not hold
    "sandbox": {"id": "sb-1"},
    "state": "stopped",
    "snapshot_id": "snap-0000000000000000",
    "held_ms": 0,
    "bytes": 0,
}


def test_bad_input_is_a_clear_4xx_and_changes_nothing(admin: Client, daemon: Daemon) -> None:
    before = [(s.id, s.state) for s in admin.list()]
    http = httpx2.Client(
        base_url=daemon.url, headers={"Authorization": f"Bearer {daemon.admin_key}"}
    )
    cases = [
        ("GET", "/v1/sandboxes/sb-0000000000000000", None, 404, "not_found"),
        ("POST", "/v1/sandboxes", {"vcpus": 0}, 400, "invalid_argument"),
        ("POST", "/v1/sandboxes", {"vcpus": 1000}, 400, "invalid_argument"),
        ("POST", "/v1/sandboxes", {"memory_mib": 64}, 400, "invalid_argument"),
        ("POST", "/v1/sandboxes", {"template": "no-such-template"}, 400, "invalid_argument"),
        ("POST", "/v1/sandboxes", {"surprise": 1}, 400, "invalid_argument"),
        ("POST", "/v1/sandboxes", {"labels": {"": "x"}}, 400, "invalid_argument"),
        ("GET", "/v1/sandboxes?state=bogus", None, 400, "invalid_argument"),
        ("GET", "/v1/no/such/route", None, 404, "not_found"),
        # a replica needs a second node: one daemon says so instead of ignoring it
        ("POST", "/v1/sandboxes", {"replicate": True}, 400, "invalid_argument"),
        ("POST", "/v1/sandboxes/recover", {"export": NO_EXPORT}, 404, "not_found"),
    ]
    for method, path, body, status, code in cases:
        r = http.request(method, path, json=body)
        assert (r.status_code, r.json()["error"]["code"]) == (status, code), (path, body, r.text)
        assert r.json()["error"]["message"]
    replicate = http.post("/v1/sandboxes", json={"replicate": True}).json()["error"]["message"]
    assert "fleet" in replicate, replicate
    r = http.post(
        "/v1/sandboxes", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_argument"
    assert [(s.id, s.state) for s in admin.list()] == before
    assert not any(
        p.name.startswith("sb-")
        for p in (daemon.data_dir / "vms").iterdir()
        if p.name not in {i for i, _ in before}
    )


def test_file_api_errors(admin: Client, daemon: Daemon) -> None:
    with admin.create() as sb:
        sb.files.write("/workspace/keep.txt", "keep")
        limit = 8 << 20  # the test daemon runs with max_upload_mib = 8
        with pytest.raises(errors.PayloadTooLarge):
            sb.files.write("/workspace/big.bin", b"x" * (limit + 1))
        # streamed without a length: cut off at the limit, nothing half-written remains
        with pytest.raises(errors.PayloadTooLarge):
            sb.files.write("/workspace/big.bin", iter([b"y" * (1 << 20)] * 9))
        assert not sb.files.exists("/workspace/big.bin")
        assert [e.name for e in sb.files.list("/workspace")] == ["keep.txt"]
        with pytest.raises(errors.NotFound):
            sb.files.read("/workspace/missing")
        with pytest.raises(errors.InvalidArgument):
            sb.files.read("relative/path")
        with pytest.raises(errors.InvalidArgument):
            sb.files.read("/etc/\x00passwd")
        with pytest.raises(errors.IsADirectory):
            sb.files.read("/workspace")
        with pytest.raises(errors.NotADirectory):
            sb.files.write("/workspace/keep.txt/child", "x")
        # `..` stays inside the guest: it names the guest's own /etc/hostname
        assert sb.files.read("/workspace/../etc/hostname") == sb.files.read("/etc/hostname")
        assert sb.files.read("/workspace/keep.txt") == b"keep"
        assert sb.exec("true").exit_code == 0


def test_a_read_only_key_looks_but_changes_nothing(
    admin: Client, alice: Client, daemon: Daemon
) -> None:
    created = admin.create_key("alice", read_only=True)
    assert created["read_only"] is True
    with (
        alice.create(labels={"for": "read-only"}) as sb,
        daemon.client(created["key"]) as looker,
    ):
        assert sb.id in [s.id for s in looker.list()]  # control: it reads alice's things
        assert looker.get(sb.id).state == "running"
        for attempt in (
            lambda: looker.create(),
            lambda: looker.get(sb.id).exec("true"),
            lambda: looker.request("POST", f"/v1/sandboxes/{sb.id}/stop"),
            lambda: looker.request("DELETE", f"/v1/sandboxes/{sb.id}"),
        ):
            with pytest.raises(errors.PermissionDenied, match="read-only"):
                attempt()
        # the foreign APIs hold it to the same rule
        e2b = httpx2.post(f"{daemon.url}/sandboxes", headers={"X-API-KEY": created["key"]}, json={})
        assert e2b.status_code == 403
        assert alice.get(sb.id).state == "running"  # nothing changed
        # the audit log of key use: every call above, refused ones included (admin only)
        uses = admin.key_uses(key_id=created["id"])
        seen = {(u.method, u.path, u.status) for u in uses}
        assert ("GET", f"/v1/sandboxes/{sb.id}", 200) in seen
        assert ("POST", f"/v1/sandboxes/{sb.id}/stop", 403) in seen
        assert ("POST", "/sandboxes", 403) in seen
        assert all(u.tenant == "alice" and u.key_id == created["id"] for u in uses)
        assert [u.id for u in uses] == sorted((u.id for u in uses), reverse=True)
        with pytest.raises(errors.PermissionDenied):
            alice.key_uses()
