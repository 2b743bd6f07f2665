"""Access delegation from the LangSmith SDK (`langsmith==0.14.17`, `access_delegation`) on a
real daemon and real microVMs: code in a sandbox calls cella's API (`http://cella.api`,
LangSmith's and /v1) as the key that created it, through the egress proxy, which adds a
short-lived token the guest never sees; the key's revocation ends that access at once, and
EXPLICIT permissions limit it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from langsmith.sandbox import Sandbox, SandboxClient

from cella import Client
from tests.daemon import Daemon

pytestmark = pytest.mark.vm

CALL = """
import json, sys, urllib.request, urllib.error
method, path = sys.argv[1], sys.argv[2]
body = sys.argv[3].encode() if len(sys.argv) > 3 else None
req = urllib.request.Request("http://cella.api" + path, data=body, method=method,
                             headers={"Content-Type": "application/json", "X-Api-Key": "mine"})
try:
    with urllib.request.urlopen(req, timeout=60) as r:
        print(json.dumps({"status": r.status, "body": r.read().decode()}))
except urllib.error.HTTPError as e:
    print(json.dumps({"status": e.code, "body": e.read().decode()}))
"""


def call(box: Sandbox, method: str, path: str, body: str | None = None) -> dict[str, Any]:
    """A request from inside the guest to cella's API host (with a key of its own, which
    the proxy must not pass on)."""
    args = f"{method} {path}" + (f" '{body}'" if body else "")
    done = box.run(f"python3 /tmp/call.py {args}", timeout=120)
    assert done.exit_code == 0, done.stderr
    answer: dict[str, Any] = json.loads(done.stdout)
    return answer


@pytest.fixture(scope="module")
def team(admin: Client) -> dict[str, Any]:
    return admin.create_key("team")


def sdk(daemon: Daemon, key: str) -> SandboxClient:
    return SandboxClient(api_endpoint=f"{daemon.url}/api/v2/sandboxes", api_key=key)


@pytest.fixture(scope="module")
def creator(daemon: Daemon, team: dict[str, Any]) -> Iterator[SandboxClient]:
    """The key the sandboxes act as (revoked by the test)."""
    c = sdk(daemon, team["key"])
    yield c
    c.close()


@pytest.fixture(scope="module")
def runner(daemon: Daemon, admin: Client) -> Iterator[SandboxClient]:
    """Another key of the same tenant, which runs the test's commands in them."""
    c = sdk(daemon, admin.create_key("team")["key"])
    yield c
    c.close()


def made(creator: SandboxClient, runner: SandboxClient, name: str, **create: Any) -> Sandbox:
    creator.create_sandbox(name=name, **create)
    box = runner.get_sandbox(name)
    box.write("/tmp/call.py", CALL)
    return box


def test_a_sandbox_calls_the_api_as_its_creator_until_the_key_is_revoked(
    creator: SandboxClient,
    runner: SandboxClient,
    admin: Client,
    team: dict[str, Any],
    daemon: Daemon,
) -> None:
    delegated = made(creator, runner, "delegated", access_delegation={"mode": "INHERIT"})
    assert delegated.access_delegation == {"mode": "INHERIT"}
    plain = made(creator, runner, "plain")
    assert plain.access_delegation is None
    explicit = {"mode": "EXPLICIT", "permissions": ["sandboxes:read"]}
    reader = made(creator, runner, "reader", access_delegation=explicit)

    listed = call(delegated, "GET", "/api/v2/sandboxes/boxes")
    assert listed["status"] == 200
    names = {b["name"] for b in json.loads(listed["body"])["sandboxes"]}
    assert names == {"delegated", "plain", "reader"}  # the team's, as its key sees them
    v1 = call(delegated, "GET", "/v1/sandboxes")  # cella's own API, the same way
    assert v1["status"] == 200 and len(json.loads(v1["body"])["sandboxes"]) == 3
    # the token: set by the proxy on the way out, never inside the guest
    seen = delegated.run(
        "env; cat /proc/1/environ /proc/self/environ | tr '\\0' '\\n'; "
        "grep -rl cdt_ /etc /root /home /tmp /var 2>/dev/null; true"
    ).stdout
    assert "cdt_" not in seen and "cdt_" not in listed["body"]
    # the LangSmith SDK in the guest is pointed at it; a sandbox without a grant is not
    assert delegated.run("echo $LANGSMITH_ENDPOINT").stdout == "http://cella.api\n"

    # the control: the same call from a sandbox without delegation is refused
    assert plain.run("echo ${LANGSMITH_ENDPOINT:-none}").stdout == "none\n"
    refused = call(plain, "GET", "/api/v2/sandboxes/boxes")
    assert refused["status"] == 403 and "denied" in refused["body"]

    # EXPLICIT sandboxes:read reads, and only reads
    assert call(reader, "GET", "/api/v2/sandboxes/boxes")["status"] == 200
    create = call(reader, "POST", "/api/v2/sandboxes/boxes", '{"name": "child"}')
    assert create["status"] == 403 and "read-only" in create["body"]

    # cella's own SDK asks for it the same way
    with Client(url=daemon.url, api_key=team["key"]) as own:
        mine = own.create(name="own-sdk", access_delegation={"mode": "inherit"})
        assert mine.info.access_delegation is not None
        assert mine.info.access_delegation.mode == "inherit"
        box = runner.get_sandbox("own-sdk")
        box.write("/tmp/call.py", CALL)
        assert call(box, "GET", f"/v1/sandboxes/{mine.id}")["status"] == 200

    # the creator's key revoked: refused on the next request
    admin.revoke_key(team["id"])
    after = call(delegated, "GET", "/api/v2/sandboxes/boxes")
    assert after["status"] == 401 and "revoked" in after["body"]
