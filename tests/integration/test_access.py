"""Who may use a sandbox, on a real daemon with a real microVM: keys of one tenant with
principals and roles, driven through cella's SDK (sync and async), the pinned LangSmith SDK
(sync and async) and the console's session. One sandbox, made by a member's key: private
until shared, then viewed, then driven by another member; the tenant's owner sees it all
along. (The rule itself, and every service room asking it: tests/unit/test_access.py.)"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx2
import pytest
from langsmith.sandbox import AsyncSandboxClient, SandboxClient
from langsmith.sandbox._exceptions import ResourceNotFoundError, SandboxClientError

from cella import AsyncClient, Client, Sandbox, errors
from tests.daemon import Daemon

pytestmark = pytest.mark.vm

NAME = "alices-box"
CALL = """
import json, sys, urllib.request, urllib.error
try:
    with urllib.request.urlopen("http://cella.api" + sys.argv[1], timeout=60) as r:
        print(json.dumps({"status": r.status, "body": r.read().decode()}))
except urllib.error.HTTPError as e:
    print(json.dumps({"status": e.code, "body": e.read().decode()}))
"""  # a GET of cella's API from the guest, as its creator (the proxy adds the token)


@pytest.fixture(scope="module")
def keys(admin: Client) -> dict[str, dict[str, Any]]:
    return {
        "alice": admin.create_key("team", principal="alice", roles=["member"]),
        "bob": admin.create_key("team", principal="bob", roles=["member"]),
        "ops": admin.create_key("team", principal="ops"),  # an owner: the default role
    }


@pytest.fixture(scope="module")
def clients(daemon: Daemon, keys: dict[str, dict[str, Any]]) -> Iterator[dict[str, Client]]:
    made = {name: daemon.client(k["key"]) for name, k in keys.items()}
    yield made
    for client in made.values():
        client.close()


@pytest.fixture(scope="module")
def box(
    daemon: Daemon, keys: dict[str, dict[str, Any]], clients: dict[str, Client]
) -> Iterator[Sandbox]:
    """Alice's sandbox, made through LangSmith's SDK as her code would make it (code in it
    calls cella's API as alice: access delegation)."""
    with ls(daemon, keys["alice"]["key"]) as alice:
        alice.create_sandbox(name=NAME, access_delegation={"mode": "INHERIT"})
    [sb] = [s for s in clients["alice"].list() if s.info.name == NAME]
    yield sb
    sb.delete()


def ls(daemon: Daemon, key: str) -> SandboxClient:
    return SandboxClient(api_endpoint=f"{daemon.url}/api/v2/sandboxes", api_key=key)


def test_keys_carry_their_principal_and_roles(
    admin: Client, keys: dict[str, dict[str, Any]]
) -> None:
    assert (keys["alice"]["principal"], keys["alice"]["roles"]) == ("alice", ["member"])
    assert (keys["ops"]["principal"], keys["ops"]["roles"]) == ("ops", ["owner"])
    listed = {k["id"]: k for k in admin.list_keys()}
    assert listed[keys["bob"]["id"]]["roles"] == ["member"]
    with pytest.raises(errors.InvalidArgument, match="not both"):
        admin.create_key("team", roles=["owner", "member"])
    with pytest.raises(errors.InvalidArgument):
        admin.create_key("team", principal="no spaces allowed")


def test_a_members_sandbox_is_private_until_shared(
    box: Sandbox, clients: dict[str, Client]
) -> None:
    alice, bob, ops = clients["alice"], clients["bob"], clients["ops"]
    box.files.write("/tmp/note", b"alice's")
    access = box.access()
    assert (access.creator, access.visibility, access.shares) == ("alice", "private", {})
    assert access.creator_key is not None and access.permission == "manage"
    # to bob, another member of the tenant, it does not exist: 404 like an unknown id
    for refused in (
        lambda: bob.get(box.id),
        lambda: bob.events(box.id),
        lambda: Sandbox(bob, box.info).exec(["true"]),
        lambda: Sandbox(bob, box.info).files.read("/tmp/note"),
        lambda: Sandbox(bob, box.info).stop(),
    ):
        with pytest.raises(errors.NotFound, match=f"no sandbox '{box.id}'"):
            refused()
    with pytest.raises(errors.NotFound, match="no sandbox 'sb-never-was'"):
        bob.get("sb-never-was")  # the same answer for an id that never was
    assert box.id not in {s.id for s in bob.list()}
    # the controls: alice drives it, and the tenant's owner sees and drives it
    assert box.exec(["echo", "mine"]).stdout == b"mine\n"
    assert ops.get(box.id).info.permission == "manage"
    assert box.id in {s.id for s in ops.list()}
    assert ops.get(box.id).exec(["true"]).exit_code == 0
    assert [s.info.permission for s in alice.list() if s.id == box.id] == ["manage"]


def test_a_view_share_inspects_and_never_drives(box: Sandbox, clients: dict[str, Client]) -> None:
    bob = clients["bob"]
    shown = box.share({"bob": "view"})
    assert shown.shares == {"bob": "view"}
    seen = bob.get(box.id)
    assert (seen.info.creator, seen.info.permission) == ("alice", "view")
    assert seen.access().permission == "view"
    assert bob.events(box.id)  # the trace is for looking
    assert seen.files.read("/tmp/note") == b"alice's"  # files too
    for refused in (
        lambda: seen.exec(["true"]),
        lambda: seen.files.write("/tmp/x", b"x"),
        lambda: seen.stop(),
        lambda: seen.fork(),
        lambda: seen.share({"bob": "manage"}),
    ):
        with pytest.raises(errors.PermissionDenied):
            refused()
    assert box.info.state.value == "running" and box.access().shares == {"bob": "view"}


async def test_an_exec_share_drives_it_sync_and_async(
    daemon: Daemon, box: Sandbox, clients: dict[str, Client], keys: dict[str, dict[str, Any]]
) -> None:
    bob = clients["bob"]
    box.share({"bob": "exec"})
    assert bob.get(box.id).exec(["echo", "shared"]).stdout == b"shared\n"
    async with AsyncClient(daemon.url, api_key=keys["bob"]["key"]) as abob:
        sb = await abob.get(box.id)
        assert (await sb.exec(["echo", "async"])).stdout == b"async\n"
        with pytest.raises(errors.PermissionDenied, match="not manage"):
            await sb.stop()  # exec is not manage
    # taken back: gone again for bob
    box.share({})
    with pytest.raises(errors.NotFound):
        bob.get(box.id)


def test_the_langsmith_sdk_follows_the_same_rule(
    daemon: Daemon, box: Sandbox, keys: dict[str, dict[str, Any]]
) -> None:
    with ls(daemon, keys["alice"]["key"]) as alice, ls(daemon, keys["bob"]["key"]) as bob:
        assert alice.get_sandbox(NAME).run("echo hi").stdout == "hi\n"  # the control
        with pytest.raises(ResourceNotFoundError):
            bob.get_sandbox(NAME)
        assert NAME not in {s.name for s in bob.list_sandboxes()}
        assert NAME in {s.name for s in alice.list_sandboxes()}
        box.share({"bob": "view"})
        try:
            seen = bob.get_sandbox(NAME)  # now it is there to look at
            assert seen.read("/tmp/note") == b"alice's"
            with pytest.raises(SandboxClientError):
                seen.run("true")  # and not to run anything in
            with pytest.raises(SandboxClientError):
                bob.delete_sandbox(NAME)
        finally:
            box.share({})
        with pytest.raises(ResourceNotFoundError):
            bob.delete_sandbox(NAME)  # unseen again: not even its deletion is known


async def test_the_async_langsmith_sdk_follows_the_same_rule(
    daemon: Daemon, box: Sandbox, keys: dict[str, dict[str, Any]]
) -> None:
    api = f"{daemon.url}/api/v2/sandboxes"
    async with AsyncSandboxClient(api_endpoint=api, api_key=keys["bob"]["key"]) as bob:
        with pytest.raises(ResourceNotFoundError):
            await bob.get_sandbox(NAME)
    async with AsyncSandboxClient(api_endpoint=api, api_key=keys["alice"]["key"]) as alice:
        assert (await alice.get_sandbox(NAME)).name == NAME  # the control


def test_a_name_held_by_a_private_sandbox_reveals_nothing(
    daemon: Daemon, box: Sandbox, keys: dict[str, dict[str, Any]], clients: dict[str, Client]
) -> None:
    """Names are unique among one creator's sandboxes and among those the tenant sees; a
    lookup by name means the caller's own first, then the tenant's. So bob names his
    sandbox as alice's private one is named, and nothing tells him hers exists; each of them
    gets their own by that name. The refusals, each with its control: bob's own name is
    taken for him; alice cannot make hers the tenant's while bob's of that name is (which
    she sees); the tenant's owner, who sees both and owns neither, is told to use an id."""
    api = f"{daemon.url}/api/v2/sandboxes"
    with ls(daemon, keys["bob"]["key"]) as bob, ls(daemon, keys["alice"]["key"]) as alice:
        made = bob.create_sandbox(name=NAME)  # not "name taken": hers is not his to know
        try:
            with pytest.raises(SandboxClientError, match="in use"):
                bob.create_sandbox(name=NAME)  # his own holds it
            assert bob.get_sandbox(NAME).run("cat /tmp/note || echo none").stdout == "none\n"
            assert alice.get_sandbox(NAME).read("/tmp/note") == b"alice's"
            box.share({"bob": "view"})  # he sees both now: his own is the one he means
            try:
                assert bob.get_sandbox(NAME).run("echo own").stdout == "own\n"
            finally:
                box.share({})
            with ls(daemon, keys["ops"]["key"]) as ops:
                with pytest.raises(SandboxClientError, match="address one by its id"):
                    ops.get_sandbox(NAME)  # an owner sees both, made neither
                [his] = [s for s in clients["bob"].list() if s.info.name == NAME]
                his.share(visibility="tenant")
                assert ops.get_sandbox(NAME).run("hostname").stdout.strip() == his.id
                with pytest.raises(errors.AlreadyExists, match="in use"):
                    box.share(visibility="tenant")  # his is the tenant's: she sees it
                assert box.access().visibility == "private"
                his.share(visibility="private")
                box.share(visibility="tenant")  # the control: free again
                box.share(visibility="private")
            assert made.name == NAME
        finally:
            bob.delete_sandbox(NAME)
    assert NAME in {s.info.name for s in clients["alice"].list()}  # hers, untouched

    async def alices() -> bytes:
        async with AsyncSandboxClient(api_endpoint=api, api_key=keys["alice"]["key"]) as a:
            return await (await a.get_sandbox(NAME)).read("/tmp/note")

    assert asyncio.run(alices()) == b"alice's"


def test_the_consoles_list_follows_the_key(
    daemon: Daemon, box: Sandbox, keys: dict[str, dict[str, Any]]
) -> None:
    def listed(who: str) -> dict[str, Any]:
        with httpx2.Client(base_url=daemon.url) as http:
            login = http.post("/ui/login", data={"key": keys[who]["key"]})
            assert login.status_code == 303
            return {s["id"]: s for s in http.get("/v1/sandboxes").json()["sandboxes"]}

    assert box.id not in listed("bob")
    assert listed("alice")[box.id]["permission"] == "manage"
    assert listed("ops")[box.id]["permission"] == "manage"
    box.share({"bob": "view"}, visibility="private")
    try:
        assert listed("bob")[box.id]["permission"] == "view"  # the page hides what it may not
    finally:
        box.share({})


def test_code_in_a_sandbox_sees_what_its_creator_sees(
    box: Sandbox, clients: dict[str, Client]
) -> None:
    """A delegation token carries its creator's principal and roles: alice's box, calling
    cella's API as alice, lists hers and not a private one of the tenant's owner."""
    theirs = clients["ops"].create(visibility="private")
    try:
        assert theirs.access().visibility == "private"
        assert {box.id, theirs.id} <= {s.id for s in clients["ops"].list()}  # the control
        box.files.write("/tmp/call.py", CALL)
        done = box.exec(["python3", "/tmp/call.py", "/v1/sandboxes"], timeout=120)
        answer = json.loads(done.stdout)
        assert answer["status"] == 200, answer
        seen = {s["id"]: s for s in json.loads(answer["body"])["sandboxes"]}
        assert theirs.id not in seen and seen[box.id]["permission"] == "manage"
        done = box.exec(["python3", "/tmp/call.py", f"/v1/sandboxes/{theirs.id}"])
        assert json.loads(done.stdout)["status"] == 404
    finally:
        theirs.delete()


def cli(daemon: Daemon, *args: str, key: str | None = None) -> Any:
    done = subprocess.run(
        [sys.executable, "-m", "cella.cli", *args, "--json"],
        env=daemon.env(key),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_cli_makes_keys_with_roles_and_shares(
    daemon: Daemon, box: Sandbox, keys: dict[str, dict[str, Any]]
) -> None:
    dave = cli(
        daemon, "keys", "create", "--tenant", "team", "--principal", "dave", "--role", "member"
    )
    assert (dave["principal"], dave["roles"]) == ("dave", ["member"])
    refused = subprocess.run(
        [sys.executable, "-m", "cella.cli", "sandbox", "get", box.id],
        env=daemon.env(dave["key"]),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert refused.returncode != 0 and "no sandbox" in refused.stderr
    alice = keys["alice"]["key"]
    shown = cli(daemon, "sandbox", "share", box.id, "--with", "dave=view", key=alice)
    assert (shown["shares"], shown["permission"]) == ({"dave": "view"}, "manage")
    assert cli(daemon, "sandbox", "get", box.id, key=dave["key"])["permission"] == "view"
    shown = cli(daemon, "sandbox", "share", box.id, "--unshare", "dave", key=alice)
    assert shown["shares"] == {}
