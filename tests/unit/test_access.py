"""Who may use a sandbox: the pure rule (`cella.policy.access`), and the service rooms that
ask it, in process against the fake runtime (the same rule through a real daemon, the SDK,
LangSmith's SDK and the console: tests/integration/test_access.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx2
import pytest

from cella import errors
from cella.config import DaemonSettings
from cella.fleet.node_client import as_header
from cella.models import ExecRequest, SandboxAccess, SandboxCreate
from cella.policy.access import (
    Access,
    Permission,
    Principal,
    Role,
    default_visibility,
    meant,
    names_clash,
    permission,
    roles_of,
)
from cella.service.daemon import Daemon
from cella.service.keys import PRINCIPAL_HEADER, ROLES_HEADER
from cella.store import Store
from tests.unit.fake_runtime import FakeDriver
from tests.unit.in_process import URL, serving

OWNER = frozenset({Role.owner})
MEMBER = frozenset({Role.member})


def key(
    name: str, roles: frozenset[Role] = MEMBER, tenant: str = "t", ro: bool = False
) -> Principal:
    return Principal(tenant, False, ro, f"key-{name}", name, roles)


ALICE, BOB, CAROL = key("alice"), key("bob"), key("carol", OWNER)


def test_a_private_sandbox_is_its_creators_and_the_owners() -> None:
    box = Access("t", "alice", "private")
    assert permission(ALICE, box) == Permission.manage
    assert permission(BOB, box) is None  # not even its existence
    assert permission(CAROL, box) == Permission.manage  # the tenant's owner sees all
    assert permission(key("alice", tenant="u"), box) is None  # the same name elsewhere
    assert permission(key("carol", OWNER, tenant="u"), box) is None  # another tenant's owner


def test_shares_give_what_they_say_and_the_tenant_visibility_gives_exec() -> None:
    for level in Permission:
        assert permission(BOB, Access("t", "alice", "private", {"bob": level})) == level
    tenant_wide = Access("t", "alice", "tenant")
    assert permission(BOB, tenant_wide) == Permission.exec
    assert permission(BOB, Access("t", "alice", "tenant", {"bob": Permission.manage})) == (
        Permission.manage
    )  # a share adds to what the tenant gets, never takes from it
    assert permission(BOB, Access("t", "alice", "tenant", {"bob": Permission.view})) == (
        Permission.exec
    )
    assert permission(BOB, Access("t", None, "tenant")) == Permission.exec  # made before


def test_a_read_only_key_only_ever_views() -> None:
    auditor = key("audit", frozenset({Role.owner, Role.viewer}), ro=True)
    assert permission(auditor, Access("t", "alice", "private")) == Permission.view
    viewer = key("bob", frozenset({Role.viewer}), ro=True)
    assert permission(viewer, Access("t", "alice", "private", {"bob": Permission.manage})) == (
        Permission.view
    )
    assert permission(viewer, Access("t", "alice", "private")) is None  # as a member would


def test_roles_and_the_default_visibility() -> None:
    assert roles_of(None, read_only=False) == OWNER  # as every key was before roles
    assert roles_of(None, read_only=True) == {Role.owner, Role.viewer}
    assert roles_of([Role.member], read_only=True) == {Role.member, Role.viewer}
    with pytest.raises(ValueError, match="not both"):
        roles_of([Role.owner, Role.member], read_only=False)
    assert default_visibility(CAROL) == "tenant" and default_visibility(ALICE) == "private"
    assert Principal.service("t").wide  # the service itself (its reaper, a download link)


def test_a_name_clashes_with_the_creators_own_and_the_tenants_only() -> None:
    assert names_clash("bob", Access("t", "bob", "private"))  # his own
    assert names_clash("bob", Access("t", "alice", "tenant"))  # one he sees as the tenant's
    assert not names_clash("bob", Access("t", "alice", "private"))  # hers: not his to know
    assert not names_clash("bob", Access("t", "alice", "private", {"bob": Permission.view}))
    assert names_clash(None, Access("t", None, "private"))  # the service's, as the same


def test_a_name_means_the_callers_own_then_the_tenants_then_the_only_other() -> None:
    hers = Access("t", "alice", "private")
    his = Access("t", "bob", "private")
    shared = Access("t", "alice", "private", {"bob": Permission.view})
    everyone = Access("t", "dave", "tenant")
    assert meant(BOB, [hers, his]) == [1]
    assert meant(ALICE, [hers, his]) == [0]
    assert meant(BOB, [hers]) == []  # not his to see: no sandbox of that name
    assert meant(BOB, [shared, everyone]) == [1]  # the tenant's before one shared with him
    assert meant(BOB, [shared, everyone, his]) == [2]
    assert meant(BOB, [shared]) == [0]
    assert meant(CAROL, [hers, his]) == [0, 1]  # an owner sees both, made neither: ambiguous
    assert meant(CAROL, [hers, his, everyone]) == [2]


# -- the rooms, in process ---------------------------------------------------------------


@pytest.fixture
async def daemon(tmp_path: Path) -> AsyncIterator[Daemon]:
    settings = DaemonSettings(data_dir=tmp_path, image_dir=tmp_path / "images", pool_size=0)
    d = Daemon(settings, Store(tmp_path / "cella.db"), FakeDriver(tmp_path))
    yield d
    await d.processes.close()
    await d.registry.detach_all()
    d.store.close()


def keyed(d: Daemon, name: str, roles: list[Role]) -> Principal:
    _, secret = d.keys.create("t", principal=name, roles=roles)
    return d.keys.authenticate(secret)


async def test_every_room_asks_the_rule(daemon: Daemon) -> None:
    alice = keyed(daemon, "alice", [Role.member])
    bob = keyed(daemon, "bob", [Role.member])
    carol = keyed(daemon, "carol", [Role.owner])
    row = await daemon.create(alice, SandboxCreate())
    assert (row.creator, row.creator_key, row.visibility) == ("alice", alice.key_id, "private")
    echo = ExecRequest(command=["true"])

    async def note() -> AsyncIterator[bytes]:
        yield b"hi"

    await daemon.files.write(alice, row.id, "/note", note())
    for refused in (
        lambda: daemon.exec.run(bob, row.id, echo),
        lambda: daemon.lifecycle.stop(bob, row.id),
        lambda: daemon.forks.fork(bob, row.id, 1),
        lambda: daemon.files.stat(bob, row.id, "/note"),
        lambda: daemon.usage.usage(bob, row.id),
    ):
        with pytest.raises(errors.NotFound):  # unknown to bob, as an id that never was
            await refused()
    with pytest.raises(errors.NotFound):
        daemon.trace.lineage(bob, row.id)
    assert daemon.registry.find(bob) == [] and daemon.registry.find(carol) != []
    assert (await daemon.exec.run(alice, row.id, echo)).exit_code == 0  # the control

    await daemon.sharing.set(alice, row.id, SandboxAccess(shares={"bob": "view"}))
    assert daemon.sharing.get(bob, row.id).permission == "view"
    assert (await daemon.files.stat(bob, row.id, "/note")).size == 2  # a view reads
    with pytest.raises(errors.PermissionDenied, match="view it, not exec"):
        await daemon.exec.run(bob, row.id, echo)
    with pytest.raises(errors.PermissionDenied):
        await daemon.sharing.set(bob, row.id, SandboxAccess(visibility="tenant"))

    await daemon.sharing.set(carol, row.id, SandboxAccess(shares={"bob": "exec"}))  # an owner
    assert (await daemon.exec.run(bob, row.id, echo)).exit_code == 0
    with pytest.raises(errors.PermissionDenied, match="not manage"):
        await daemon.lifecycle.stop(bob, row.id)
    [fork] = await daemon.forks.fork(bob, row.id, 1)  # the fork is bob's, and private
    assert (fork.creator, fork.visibility, fork.shares) == ("bob", "private", {})
    with pytest.raises(errors.NotFound):
        daemon.registry.get(alice, fork.id)
    assert [r.id for r in daemon.registry.find(alice)] == [row.id]
    assert {r.id for r in daemon.registry.find(carol)} == {row.id, fork.id}
    await daemon.lifecycle.delete(bob, fork.id)  # its creator manages it

    # a manager may share it away from itself too: then it no longer sees it
    await daemon.sharing.set(alice, row.id, SandboxAccess(shares={"bob": "manage"}))
    left = await daemon.sharing.set(bob, row.id, SandboxAccess(shares={}))
    assert left.permission is None and left.shares == {}
    with pytest.raises(errors.NotFound):
        daemon.registry.get(bob, row.id)
    assert daemon.sharing.get(alice, row.id).permission == "manage"  # its creator still


async def test_names_reveal_no_private_sandbox(daemon: Daemon) -> None:
    alice = keyed(daemon, "alice", [Role.member])
    bob = keyed(daemon, "bob", [Role.member])
    carol = keyed(daemon, "carol", [Role.owner])
    hers = await daemon.create(alice, SandboxCreate(name="box"))
    his = await daemon.create(bob, SandboxCreate(name="box"))  # hers is not his to know
    assert daemon.registry.named(alice, "box").id == hers.id
    assert daemon.registry.named(bob, "box").id == his.id
    with pytest.raises(errors.AlreadyExists, match="in use"):
        await daemon.create(bob, SandboxCreate(name="box"))  # his own holds it
    with pytest.raises(errors.Conflict, match="address one by its id"):
        daemon.registry.named(carol, "box")  # sees both, made neither
    other = await daemon.create(bob, SandboxCreate(name="other"))
    with pytest.raises(errors.AlreadyExists):  # renamed onto his own name: refused
        await daemon.lifecycle.update(bob, other.id, name="box")
    await daemon.sharing.set(bob, his.id, SandboxAccess(visibility="tenant"))
    assert daemon.registry.named(carol, "box").id == his.id  # the tenant's
    assert daemon.registry.named(alice, "box").id == hers.id  # her own first
    with pytest.raises(errors.AlreadyExists):  # his is the tenant's, which she sees
        await daemon.sharing.set(alice, hers.id, SandboxAccess(visibility="tenant"))
    with pytest.raises(errors.AlreadyExists):
        await daemon.create(carol, SandboxCreate(name="box"))
    await daemon.sharing.set(bob, his.id, SandboxAccess(visibility="private"))
    await daemon.sharing.set(alice, hers.id, SandboxAccess(visibility="tenant"))  # control
    made = await daemon.create(carol, SandboxCreate(name="free"))  # control of the refusal
    assert daemon.registry.named(bob, "free").id == made.id  # an owner's: the tenant's


# -- a fleet gateway relaying its caller -----------------------------------------------


def test_a_gateway_names_its_caller_to_the_node() -> None:
    assert as_header(ALICE) == {
        "x-cella-tenant": "t",
        PRINCIPAL_HEADER: "alice",
        ROLES_HEADER: "member",
    }
    viewer = key("audit", frozenset({Role.owner, Role.viewer}), ro=True)
    assert as_header(viewer)[ROLES_HEADER] == "owner,viewer"


async def test_a_node_applies_the_rule_to_the_caller_a_gateway_names(tmp_path: Path) -> None:
    async with serving(tmp_path) as app:
        async with app.client() as admin:
            alice = await admin.create_key("t", principal="alice", roles=["member"])
        async with app.client(alice["key"]) as client:
            mine = await client.create()
        transport = httpx2.ASGITransport(app=app.app)
        node = {"authorization": f"Bearer {app.admin_key}", "x-cella-tenant": "t"}
        async with httpx2.AsyncClient(transport=transport, base_url=URL, headers=node) as http:

            async def seen(**relayed: str) -> int:
                r = await http.get(f"/v1/sandboxes/{mine.id}", headers=relayed)
                return r.status_code

            assert await seen() == 200  # the tenant's owner (no caller named)
            assert await seen(**{PRINCIPAL_HEADER: "alice", ROLES_HEADER: "member"}) == 200
            assert await seen(**{PRINCIPAL_HEADER: "bob", ROLES_HEADER: "member"}) == 404
            assert await seen(**{ROLES_HEADER: "owner,member"}) == 400
            assert await seen(**{PRINCIPAL_HEADER: "not a name"}) == 400
        # only an admin key may name a caller: a tenant key with the headers is refused
        with pytest.raises(errors.PermissionDenied):
            async with app.client(alice["key"], headers={"x-cella-tenant": "t"}) as relayed:
                await relayed.get(mine.id)
