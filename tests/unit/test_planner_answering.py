"""A node that is up in Ray's eyes but whose daemon hangs or refuses does not fail a create:
the planner waits a bounded time for its reports, places on the nodes that answered, and
leaves it out for a while (longer each time it fails again) before asking it again (the
planner's own code over stand-in nodes answering as node daemons do; on a real fleet with a
stopped daemon: tests/fleet/placement_checks.py)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx2
import pytest

from cella import errors
from cella.fleet import planner as planner_module
from cella.fleet.answering import FIRST_PAUSE_S, LONGEST_PAUSE_S, Answering
from cella.fleet.node_client import Node
from cella.fleet.planner import Planner, Shape
from tests.unit.test_planner_sample import Members

SHAPE = Shape(1, 512, "default")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Daemon:
    """A node daemon's answers, which can be made to hang or refuse."""

    def __init__(self, name: str, memory_mib: int) -> None:
        self.name = name
        self.memory_mib = memory_mib
        self.mode = "answers"  # or "hangs", "refuses"
        self.asked = 0

    async def answer(self, request: httpx2.Request) -> httpx2.Response:
        self.asked += 1
        if self.mode == "hangs":
            await asyncio.sleep(3600)
        if self.mode == "refuses":
            return httpx2.Response(503, content=b"busy")
        body: Any = {"status": "ok", "pool": {}}
        if request.url.path == "/v1/capacity":
            body = {"memory_mib": self.memory_mib, "memory_mib_committed": 0, "vcpus": 8,
                    "vcpus_committed": 0, "live_sandboxes": 0}  # fmt: skip
        elif request.url.path == "/v1/templates":
            body = {"templates": [{"name": "default", "built": True}]}
        return httpx2.Response(200, content=json.dumps(body).encode())

    def node(self) -> Node:
        made = Node(self.name, self.name, f"http://{self.name}.test", "key")
        made.client = httpx2.AsyncClient(
            base_url=made.url, transport=httpx2.MockTransport(self.answer)
        )
        return made


@pytest.fixture(autouse=True)
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(planner_module, "REPORT_TIMEOUT_S", 0.2)


def fleet(clock: Clock) -> tuple[Planner, dict[str, Daemon]]:
    daemons = {"n1": Daemon("n1", 8192), "n2": Daemon("n2", 4096), "n3": Daemon("n3", 2048)}
    nodes = [d.node() for d in daemons.values()]
    return Planner(Members(nodes), answering=Answering(clock)), daemons  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["hangs", "refuses"])
async def test_a_node_that_does_not_answer_is_placed_around_then_used_again(mode: str) -> None:
    clock = Clock()
    planner, daemons = fleet(clock)
    assert await planner.plan(SHAPE, 1, set()) == {"n1": 1}  # the freest, while it answers
    daemons["n1"].mode = mode
    assert await planner.plan(SHAPE, 1, set()) == {"n2": 1}  # bounded wait, then the rest
    assert planner.answering.left_out() == {"n1"}
    asked = daemons["n1"].asked
    assert await planner.plan(SHAPE, 1, set(), prefer="n1") == {"n2": 1}
    assert daemons["n1"].asked == asked  # left out: not asked, not waited for
    daemons["n1"].mode = "answers"
    clock.now += FIRST_PAUSE_S
    assert await planner.plan(SHAPE, 1, set()) == {"n1": 1}  # the control: asked, used again
    assert planner.answering.left_out() == set()


async def test_a_node_that_keeps_failing_is_left_out_longer() -> None:
    clock = Clock()
    planner, daemons = fleet(clock)
    daemons["n1"].mode = "refuses"
    pauses = []
    for _ in range(6):
        await planner.plan(SHAPE, 1, set())
        silence = planner.answering._silent["n1"]
        pauses.append(silence.until - clock.now)
        assert "503" in (planner.answering.reason("n1") or "")  # why, as the node said it
        clock.now = silence.until  # asked again once its pause is over
    assert pauses == [min(LONGEST_PAUSE_S, FIRST_PAUSE_S * 2**i) for i in range(6)]


async def test_with_no_node_answering_the_create_is_refused_plainly() -> None:
    clock = Clock()
    planner, daemons = fleet(clock)
    for daemon in daemons.values():
        daemon.mode = "hangs"
    with pytest.raises(errors.NodeUnavailable, match="no node of the fleet answered"):
        await asyncio.wait_for(planner.plan(SHAPE, 1, set()), 5)
    for daemon in daemons.values():  # all left out: the next create asks them all again
        daemon.mode = "answers"
    assert await planner.plan(SHAPE, 1, set()) == {"n1": 1}


async def test_what_is_held_for_creates_in_flight_is_not_counted_twice() -> None:
    """A create admitted at its node but not yet answered is in the node's report and in the
    planner's holds: the node's room decides, so a burst is not refused room it has. A node
    with no room by its own report is still refused (the control)."""
    planner, daemons = fleet(Clock())
    daemons["n2"].memory_mib = daemons["n3"].memory_mib = 0  # only n1 has room: 8192 MiB
    with planner.reserve({"n1": 12}, SHAPE):  # 12 of 512 MiB in flight (6 GiB) held...
        daemons["n1"].memory_mib = 2048  # ...and in n1's report already: 2 GiB free
        assert await planner.plan(SHAPE, 2, set()) == {"n1": 2}
        daemons["n1"].memory_mib = 0
        with pytest.raises(errors.CapacityExceeded):
            await planner.plan(SHAPE, 1, set())
