"""Sandboxes moving between the fleet's nodes: a drained node's running sandbox goes on
elsewhere with its memory and files (same id), a stopped one moved boots there with its
files, and moves to nodes that cannot take them are refused (collected by
`tests/integration/test_fleet.py` only, inside a loopback-only network namespace)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx2
import pytest

from cella import Client, errors
from cella.sdk import Sandbox
from tests.fleet.conftest import SHAPE, Fleet

# a counter kept in a shell's memory, written out every 0.2 s: if the shell were started
# again it would count from 1
COUNTER = (
    "sh -c 'echo $$ > /run/counter.pid; i=0; "
    "while :; do i=$((i+1)); echo $i > /run/counter; sleep 0.2; done' >/dev/null 2>&1 &"
)
SLEEPER = "sh -c 'echo $$ > /run/counter.pid; exec sleep 100000' >/dev/null 2>&1 &"


@pytest.fixture
def client(fleet: Fleet, tenant: httpx2.Client) -> Iterator[Client]:
    key = tenant.headers["authorization"].split()[1]
    with Client(fleet.gateway.url, key) as sdk:
        yield sdk


def on(client: Client, node: str) -> Sandbox:
    """A sandbox the gateway places on `node` if it may (the hint is a preference)."""
    answer = client.request("POST", "/v1/sandboxes", json=SHAPE, headers={"X-Cella-Node": node})
    return client.get(answer.json()["id"])


def cli(fleet: Fleet, *args: str) -> subprocess.CompletedProcess[str]:
    """`cella fleet ARGS` as the gateway's admin."""
    return subprocess.run(
        [sys.executable, "-m", "cella.cli", "fleet", *args],
        env=fleet.gateway.env(),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def counter(sb: Sandbox) -> int:
    return int(sb.exec("cat /run/counter").stdout)


def started(sb: Sandbox) -> str:
    """The kernel's start time of the process that wrote the pid file (field 22 of its
    stat): the same value after a move means the same process, not a new one."""
    return sb.exec("cut -d' ' -f22 /proc/$(cat /run/counter.pid)/stat").stdout.decode().strip()


def test_a_drain_moves_a_running_sandbox_with_its_memory_and_files(
    fleet: Fleet, client: Client
) -> None:
    mover = on(client, "n1")
    control = on(client, "n3")
    try:
        assert fleet.node_of(mover.id) == "n1" and fleet.node_of(control.id) == "n3"
        mover.exec(COUNTER)
        mover.files.write("/root/kept.txt", "on the disk")
        control.exec(SLEEPER)
        time.sleep(1)
        before, began = counter(mover), started(mover)
        control_began = started(control)
        assert before > 1

        # drained through the CLI (its SDK, the gateway's route), its report as JSON
        drained = cli(fleet, "drain", "n1", "--json")
        report = json.loads(drained.stdout)
        [moved] = [m for m in report["moves"] if m["id"] == mover.id]
        assert moved["ok"], moved
        assert moved["from"] == "n1" and moved["to"] not in (None, "n1"), moved
        assert moved["state"] == "running"
        assert moved["paused_ms"] > 0 and moved["bytes"] > 0 and moved["transfer_ms"] > 0
        # its disk so far and the RAM under its memory went ahead, while it ran
        assert moved["precopy_ms"] > 0 and moved["precopy_bytes"] > 0, moved
        # the CLI exits 1 if any sandbox of n1 stayed (each says why)
        stayed = [m for m in report["moves"] if not m["ok"]]
        assert drained.returncode == (1 if stayed else 0), drained.stderr
        assert all(m["error"] for m in stayed), stayed

        # the same sandbox, on the node the report names, running on from where it was
        assert fleet.node_of(mover.id) == moved["to"]
        assert mover.refresh().state == "running" and mover.id == moved["id"]
        after = counter(mover)
        assert after >= before, (before, after)  # counting on, not from 1 again
        assert started(mover) == began  # the same process
        time.sleep(0.6)
        assert counter(mover) > after  # and still counting
        assert mover.files.read("/root/kept.txt") == b"on the disk"

        # the control: a sandbox on another node was not touched
        assert fleet.node_of(control.id) == "n3"
        assert control.refresh().state == "running"
        assert started(control) == control_began

        # n1 is cordoned: nothing new goes there, not even when asked for
        status = fleet.admin.get("/v1/fleet").json()
        assert {n["name"]: n["cordoned"] for n in status["nodes"]}["n1"] is True
        asked = on(client, "n1")
        assert fleet.node_of(asked.id) != "n1"
        asked.delete()
        with pytest.raises(errors.InvalidState, match="cordoned"):
            mover.move("n1")
        with pytest.raises(errors.InvalidArgument, match="no node"):
            mover.move("n9")
        assert fleet.node_of(mover.id) == moved["to"]  # refused moves left it there
        assert counter(mover) > after
    finally:
        uncordoned = cli(fleet, "uncordon", "n1")
        for sb in (mover, control):
            sb.delete()
    assert uncordoned.returncode == 0, uncordoned.stderr
    status = fleet.admin.get("/v1/fleet").json()
    assert not any(n["cordoned"] for n in status["nodes"])


def test_a_stopped_sandbox_moves_and_boots_there_with_its_files(
    fleet: Fleet, client: Client
) -> None:
    sb = on(client, "n2")
    try:
        sb.files.write("/root/kept.txt", "stopped, moved")
        sb.stop()
        report = sb.move("n1")  # open again: the last check uncordoned it
        assert report.ok and report.source == "n2" and report.to == "n1"
        assert report.state == "stopped" and report.paused_ms is None
        assert report.precopy_ms is None  # nothing runs: its disk goes in one piece
        assert sb.refresh().state == "stopped"
        assert fleet.node_of(sb.id) == "n1"
        sb.resume()
        assert sb.files.read("/root/kept.txt") == b"stopped, moved"
        # moved again with no node named: the planner picks one other than its own
        again = sb.move()
        assert again.ok and again.source == "n1" and again.to not in (None, "n1")
        assert fleet.node_of(sb.id) == again.to
        assert sb.files.read("/root/kept.txt") == b"stopped, moved"
    finally:
        sb.delete()
