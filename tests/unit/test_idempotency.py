"""Idempotency keys on the store: a key's work runs once (retries, also concurrent ones, get
its result), another body under the key is refused, a failure leaves nothing behind, a key
the daemon stopped during runs again, keys are the tenant's and the route's, and expire."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from cella import errors
from cella.service.idempotency import Idempotency, body_hash
from cella.store import IdempotencyRecord, Store


def room(tmp_path: Path) -> Idempotency:
    return Idempotency(Store(tmp_path / "cella.db"))


class Counter:
    def __init__(self) -> None:
        self.runs = 0
        self.gate = asyncio.Event()

    async def work(self) -> list[str]:
        self.runs += 1
        await self.gate.wait()
        return [f"sb-{self.runs}"]


async def test_concurrent_retries_wait_for_the_first_and_get_its_result(tmp_path: Path) -> None:
    idem, made = room(tmp_path), Counter()
    first = asyncio.create_task(idem.once("t", "create", "k1", {"a": 1}, made.work))
    await asyncio.sleep(0)
    second = asyncio.create_task(idem.once("t", "create", "k1", {"a": 1}, made.work))
    await asyncio.sleep(0.05)
    assert not second.done()  # it waits for the first
    made.gate.set()
    assert await first == await second == ["sb-1"]
    assert await idem.once("t", "create", "k1", {"a": 1}, made.work) == ["sb-1"]  # later
    assert made.runs == 1
    # the control: another key, another tenant or another route runs again
    assert await idem.once("t", "create", "k2", {"a": 1}, made.work) == ["sb-2"]
    assert await idem.once("u", "create", "k1", {"a": 1}, made.work) == ["sb-3"]
    assert await idem.once("t", "fork:sb-1", "k1", {"a": 1}, made.work) == ["sb-4"]
    assert await idem.once("t", "create", None, {"a": 1}, made.work) == ["sb-5"]  # no key
    assert made.runs == 5


async def test_another_body_under_the_key_is_refused(tmp_path: Path) -> None:
    idem, made = room(tmp_path), Counter()
    made.gate.set()
    await idem.once("t", "create", "k", {"a": 1, "b": [1, 2]}, made.work)
    assert await idem.once("t", "create", "k", {"b": [1, 2], "a": 1}, made.work) == ["sb-1"]
    with pytest.raises(errors.Conflict, match="another request body"):
        await idem.once("t", "create", "k", {"a": 2}, made.work)
    with pytest.raises(errors.InvalidArgument, match="printable ASCII"):
        await idem.once("t", "create", "k\n", {"a": 1}, made.work)
    assert made.runs == 1


async def test_a_failure_is_shared_with_waiters_and_then_forgotten(tmp_path: Path) -> None:
    idem = room(tmp_path)
    gate = asyncio.Event()

    async def fails() -> list[str]:
        await gate.wait()
        raise errors.InvalidState("no room")

    first = asyncio.create_task(idem.once("t", "create", "k", {}, fails))
    await asyncio.sleep(0)
    second = asyncio.create_task(idem.once("t", "create", "k", {}, fails))
    await asyncio.sleep(0.01)
    gate.set()
    for task in (first, second):
        with pytest.raises(errors.InvalidState):
            await task
    made = Counter()
    made.gate.set()
    assert await idem.once("t", "create", "k", {}, made.work) == ["sb-1"]  # runs afresh


async def test_a_key_left_running_by_a_stopped_daemon_runs_again(tmp_path: Path) -> None:
    idem, made = room(tmp_path), Counter()
    made.gate.set()
    idem.store.claim_idempotency(IdempotencyRecord("t", "create", "k", "0" * 64, None, 1e12))
    with pytest.raises(errors.Conflict):  # its body still counts
        await idem.once("t", "create", "k", {}, made.work)
    again = Idempotency(idem.store)  # a new daemon on the same store
    idem.store.claim_idempotency(IdempotencyRecord("t", "create", "k2", body_hash({}), None, 1e12))
    assert await again.once("t", "create", "k2", {}, made.work) == ["sb-1"]


async def test_keys_expire(tmp_path: Path) -> None:
    idem, made = room(tmp_path), Counter()
    made.gate.set()
    idem.keep_seconds = 0.05
    await idem.once("t", "create", "k", {}, made.work)
    await asyncio.sleep(0.1)
    assert await idem.once("t", "create", "k", {"now": "else"}, made.work) == ["sb-2"]
