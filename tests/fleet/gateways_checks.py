"""Two gateways of one fleet sharing their state in PostgreSQL (collected by
`tests/integration/test_fleet.py` only, inside a loopback-only network namespace).

Beside the session's gateway (SQLite, untouched), two more gateways join the same Ray
cluster and node daemons, their state in a throwaway PostgreSQL server (Debian's, on
loopback); a node cordoned and a replica recorded through one is known to the other;
clients of both run creates and execs, one gateway is killed in the middle of a call, and
the loop goes on through the other.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import httpx2
import pytest

from cella import Client
from cella.sdk import Sandbox
from tests.daemon import Daemon
from tests.fleet.conftest import QUOTA, SHAPE, Fleet
from tests.postgres import postgres_server

T = TypeVar("T")
# what every gateway of the fleet must be given alike (the database's sealed secrets, the
# console's sessions and the nodes' rewrite tokens are made with them)
SHARED_KEYS = ("secrets.key", "session.key", "rewrites.key")


@dataclass
class Pair:
    a: Daemon
    b: Daemon
    key: str  # a tenant's key, made at `a`
    fleet: Fleet


@pytest.fixture(scope="module")
def pair(fleet: Fleet) -> Iterator[Pair]:
    root = fleet.node_root.parent
    with postgres_server() as url:
        args = ["--ray", fleet.cluster.address, "--node-root", str(fleet.node_root)]
        settings = {"database_url": url, "max_sandboxes_per_tenant": str(QUOTA)}
        a = Daemon(root / "gateway-a", args=args, **settings)
        b = Daemon(root / "gateway-b", args=args, **settings)
        try:
            a.start(timeout=240)
            b.data_dir.mkdir(parents=True)
            for name in SHARED_KEYS:
                shutil.copy2(a.data_dir / name, b.data_dir / name)
            b.start(timeout=240)
            made = httpx2.post(
                f"{a.url}/v1/keys",
                json={"tenant": "duo"},
                headers={"authorization": f"Bearer {a.admin_key}"},
            )
            assert made.status_code == 201, made.text
            yield Pair(a, b, made.json()["key"], fleet)
        finally:
            a.stop()
            b.stop()


def cli(env: dict[str, str], *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "cella.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def tenant_of(pair: Pair, gateway: Daemon | None = None) -> httpx2.Client:
    """The tenant's client of gateway b (or the one given)."""
    return httpx2.Client(
        base_url=(gateway or pair.b).url,
        headers={"authorization": f"Bearer {pair.key}"},
        timeout=180,
    )


def placed_on(pair: Pair, sandbox_id: str) -> str:
    """The node whose data directory holds the sandbox's VM."""
    root = pair.fleet.node_root
    held = [n for n in os.listdir(root) if (root / n / "vms" / sandbox_id).exists()]
    assert len(held) == 1, f"{sandbox_id} is on {held}"
    return held[0]


def answers(url: str, key: str) -> int:
    return httpx2.get(
        f"{url}/v1/sandboxes", headers={"authorization": f"Bearer {key}"}, timeout=30
    ).status_code


def test_a_key_made_at_one_gateway_works_at_the_other(pair: Pair) -> None:
    assert answers(pair.a.url, pair.key) == 200
    assert answers(pair.b.url, pair.key) == 200
    # control: a key neither made is refused by both, the same way
    assert answers(pair.a.url, "cella_wrong") == 401
    assert answers(pair.b.url, "cella_wrong") == 401


def admin_of(gateway: Daemon) -> httpx2.Client:
    return httpx2.Client(
        base_url=gateway.url,
        headers={"authorization": f"Bearer {gateway.admin_key}"},
        timeout=180,
    )


def test_a_node_cordoned_through_one_gateway_is_cordoned_at_the_other(pair: Pair) -> None:
    """Cordoned through gateway a: gateway b shows it cordoned and places nothing there,
    even asked for it; uncordoned through b, a places there again (the control)."""
    with admin_of(pair.a) as a, admin_of(pair.b) as b, tenant_of(pair) as at_b:
        nodes = sorted(n["name"] for n in b.get("/v1/fleet").json()["nodes"] if n["healthy"])
        assert len(nodes) >= 2, nodes
        node = nodes[0]
        made: list[str] = []
        try:
            assert a.post(f"/v1/fleet/nodes/{node}/cordon").json()["cordoned"] is True
            shown = {n["name"]: n["cordoned"] for n in b.get("/v1/fleet").json()["nodes"]}
            assert shown[node] is True and not any(v for k, v in shown.items() if k != node)
            answer = at_b.post("/v1/sandboxes", json=SHAPE, headers={"X-Cella-Node": node})
            assert answer.status_code == 201, answer.text
            made.append(answer.json()["id"])
            assert placed_on(pair, made[-1]) != node
            assert b.post(f"/v1/fleet/nodes/{node}/uncordon").json()["cordoned"] is False
            shown = {n["name"]: n["cordoned"] for n in a.get("/v1/fleet").json()["nodes"]}
            assert shown[node] is False
            with tenant_of(pair, pair.a) as at_a:
                answer = at_a.post("/v1/sandboxes", json=SHAPE, headers={"X-Cella-Node": node})
                assert answer.status_code == 201, answer.text
                made.append(answer.json()["id"])
            assert placed_on(pair, made[-1]) == node
        finally:
            b.post(f"/v1/fleet/nodes/{node}/uncordon")
            for sandbox_id in made:
                at_b.delete(f"/v1/sandboxes/{sandbox_id}")


def test_a_replica_recorded_by_one_gateway_is_known_to_the_other(pair: Pair) -> None:
    """A replicated sandbox made through gateway a: b knows it is replicated, refreshes its
    replica, and a reads what b recorded; control: an unreplicated one is not, at b."""
    with tenant_of(pair, pair.a) as at_a, tenant_of(pair) as at_b:
        kept = at_a.post("/v1/sandboxes", json={**SHAPE, "replicate": True})
        assert kept.status_code == 201, kept.text
        plain = at_a.post("/v1/sandboxes", json=SHAPE)
        assert plain.status_code == 201, plain.text
        kept_id, plain_id = kept.json()["id"], plain.json()["id"]
        try:
            assert at_b.get(f"/v1/sandboxes/{kept_id}").json()["replicate"] is True
            assert at_b.get(f"/v1/sandboxes/{kept_id}/replica").status_code == 200
            refreshed = at_b.post(f"/v1/sandboxes/{kept_id}/replica")
            assert refreshed.status_code == 200, refreshed.text
            copy = refreshed.json()
            assert copy["node"] and copy["taken_at"] and copy["error"] is None, copy
            assert copy["node"] != placed_on(pair, kept_id)
            assert (
                at_a.get(f"/v1/sandboxes/{kept_id}/replica").json()
                | {"age_seconds": copy["age_seconds"]}
                == copy
            )
            refused = at_b.get(f"/v1/sandboxes/{plain_id}/replica")  # the control
            assert refused.status_code == 404 and "not replicated" in refused.text
        finally:
            at_b.delete(f"/v1/sandboxes/{kept_id}")
            at_b.delete(f"/v1/sandboxes/{plain_id}")


def test_a_client_loop_goes_on_when_its_gateway_is_killed(pair: Pair) -> None:
    """Creates and execs through clients of both gateways (each tries its own first); the
    first gateway is killed while a command runs through it; that call is the loop's one
    retry, every other call answers, and the sandboxes made through the dead gateway answer
    through the other."""
    retries = 0

    def attempt(call: Callable[[], T]) -> T:
        nonlocal retries
        try:
            return call()
        except httpx2.TransportError:
            retries += 1  # a call cut off while it ran (not safe to repeat by itself)
            return call()

    via_a = Client([pair.a.url, pair.b.url], pair.key, timeout=180)
    via_b = Client([pair.b.url, pair.a.url], pair.key, timeout=180)
    made: list[Sandbox] = []
    try:
        for client in (via_a, via_b):
            box = attempt(lambda c=client: c.create(**SHAPE))  # type: ignore[misc]
            made.append(box)
            done = attempt(lambda b=box: b.exec(["echo", b.id]))  # type: ignore[misc]
            assert done.stdout.decode().strip() == box.id
        first = made[0]  # made through gateway a
        assert via_a.url == pair.a.url and via_a._http._transport.current == 0  # type: ignore[attr-defined]

        # a command runs through gateway a; a is killed while it does
        outcome: list[object] = []

        def long_call() -> None:
            try:
                outcome.append(first.exec("touch /tmp/started; sleep 30; echo late"))
            except httpx2.TransportError as exc:
                outcome.append(exc)

        running = threading.Thread(target=long_call)
        running.start()
        deadline = time.monotonic() + 120
        while via_b.get(first.id).exec(["test", "-f", "/tmp/started"]).exit_code != 0:
            assert time.monotonic() < deadline, "the command never started"
            time.sleep(0.2)
        pair.a.kill9()
        running.join(timeout=60)
        assert len(outcome) == 1 and isinstance(outcome[0], httpx2.TransportError), outcome
        retries += 1  # the loop repeats that call: through gateway b now
        again = attempt(lambda: first.exec(["echo", "again"]))
        assert again.stdout.decode().strip() == "again"

        # the loop goes on with the same clients: a's now go to b, with no error
        for client in (via_a, via_b):
            box = attempt(lambda c=client: c.create(**SHAPE))  # type: ignore[misc]
            made.append(box)
            done = attempt(lambda b=box: b.exec(["echo", b.id]))  # type: ignore[misc]
            assert done.stdout.decode().strip() == box.id
        assert retries == 1
        assert via_a._http._transport.failovers >= 1  # type: ignore[attr-defined]
        # every sandbox, those made through a too, answers through b alone
        alone = Client(pair.b.url, pair.key, timeout=180)
        for box in made:
            found = alone.get(box.id)
            assert found.info.state == "running"
            assert found.exec(["echo", "here"]).stdout.decode().strip() == "here"
        alone.close()
        # the CLI too, given both (the dead one first)
        env = {**os.environ, "CELLA_URL": f"{pair.a.url},{pair.b.url}", "CELLA_API_KEY": pair.key}
        listed = cli(env, "sandbox", "ls", "--json")
        assert all(box.id in listed for box in made), listed
        assert cli(env, "sandbox", "exec", first.id, "--", "echo", "by-cli").strip() == "by-cli"
        # the losses of gone nodes are written by one gateway: b took that over from a
        deadline = time.monotonic() + 60
        while "writes the fleet's losses" not in pair.b.log.read_text():
            assert time.monotonic() < deadline, "gateway b did not take the lease over"
            time.sleep(0.5)
    finally:
        for box in made:  # cleaning up: the check's own failure says what went wrong
            with contextlib.suppress(Exception):
                via_b.get(box.id).delete()
        via_a.close()
        via_b.close()
