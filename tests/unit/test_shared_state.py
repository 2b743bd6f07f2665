"""The gateway's state, the same on both backends: SQLite files (one gateway) and a real
PostgreSQL server (Debian's, on loopback, started here) that several gateways share."""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cella import errors
from cella.config import DaemonSettings
from cella.fleet.delegation import Delegations
from cella.fleet.homes import Home, Homes
from cella.fleet.placement_table import Placements
from cella.service.idempotency import Idempotency
from cella.service.keys import Keys
from cella.store import IdempotencyRecord, KeyUse, RegistryRecord, SecretRecord, Store
from cella.store.migrations import MIGRATIONS
from cella.store.observe import WebhookRecord
from cella.store.sealing import Sealer
from cella.store.sql import Lease, Presence, open_database
from tests.postgres import fresh_database, postgres_server

KEY = os.urandom(32)
NAMES = itertools.count()


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with postgres_server() as url:
        yield url


@pytest.fixture(params=["sqlite", "postgres"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """Where a gateway keeps its state: a directory of SQLite files, or a fresh database."""
    if request.param == "sqlite":
        yield str(tmp_path)
    else:
        yield fresh_database(request.getfixturevalue("server"), f"t{next(NAMES)}")


def place(where: str, file: str) -> Path | str:
    return where if where.startswith("postgresql://") else Path(where) / file


def store_at(where: str) -> Store:
    store = Store(place(where, "gateway.db"))
    store.seal_with(Sealer(KEY))
    return store


def test_keys_sessions_and_key_uses(where: str) -> None:
    store = store_at(where)
    assert store.schema_version == len(MIGRATIONS)
    store.add_key("k1", "acme", "h1", admin=True, roles=["owner"])
    found = store.key_by_hash("h1")
    assert found is not None and found.admin and found.tenant == "acme"
    assert store.key_by_hash("nope") is None  # control: an unknown hash finds nothing
    assert store.revoke_key("k1") and not store.revoke_key("k1")
    assert store.key_by_hash("h1") is None
    expires = int(time.time()) + 60
    store.end_session("n1", expires)
    store.end_session("n1", expires)  # ended twice: still one row, no error
    assert store.session_ended("n1") and not store.session_ended("n2")
    uses = [KeyUse("k1", "acme", f"t{i}", "GET", "/v1/x", 200, None) for i in range(3)]
    store.add_key_uses(uses, keep=10)
    assert [u.at for u in store.key_uses("k1", None, 2)] == ["t2", "t1"]


def test_sealed_values_and_conflicts(where: str) -> None:
    store = store_at(where)
    store.put_secret(SecretRecord("acme", "tok", "s3cret", ["api.example.com"]))
    store.put_secret(SecretRecord("acme", "tok", "s3cret2", ["api.example.com"]))
    got = store.get_secret("acme", "tok")
    assert got is not None and got.value == "s3cret2" and got.version == 2
    store.put_registry(RegistryRecord("r1", "acme", "hub", "https://r.example", "u", "pw"))
    with pytest.raises(errors.Conflict):  # the same name under another id
        store.put_registry(RegistryRecord("r2", "acme", "hub", "https://r.example"))
    registry = store.get_registry("acme", "hub")
    assert registry is not None and registry.password == "pw"
    store.put_webhook(WebhookRecord("w1", "acme", "hook", "http://127.0.0.1:1/", ["*"], "k"))
    assert [h.secret for h in store.list_webhooks("acme")] == ["k"]
    # another process on the same state with another key is refused, nothing changed
    other = Store(place(where, "gateway.db"))
    with pytest.raises(errors.HostError):
        other.seal_with(Sealer(os.urandom(32)))


def test_idempotency_and_eval_results(where: str) -> None:
    store = store_at(where)
    record = IdempotencyRecord("acme", "sandboxes.create", "key-1", "hash", None, time.time())
    store.claim_idempotency(record)
    store.claim_idempotency(record)  # a retry of one that never ended claims it again
    store.finish_idempotency("acme", "sandboxes.create", "key-1", ["sb-1"])
    seen = store.idempotency("acme", "sandboxes.create", "key-1")
    assert seen is not None and seen.result == ["sb-1"]
    assert store.idempotency("acme", "sandboxes.fork", "key-1") is None  # per route
    store.put_eval_result("run", "t1", "sb-1", True, None, '{"a": 1}')
    store.put_eval_result("run", "t2", "sb-2", False, None, '{"a": 2}')
    store.put_eval_result("run", "t2", "sb-2", False, "boom", '{"a": 3}')  # replaced
    assert store.eval_counts("run") == (1, 0, 1)
    assert store.eval_results("run") == ['{"a": 1}', '{"a": 3}']


def test_placements_homes_and_grants(where: str) -> None:
    placements = Placements(place(where, "placements.db"))
    placements.put("n1", {"id": "a", "tenant": "acme", "state": "running"})
    placements.put("n1", {"id": "b", "tenant": "acme", "state": "running"})
    placements.put("n2", {"id": "c", "tenant": "acme", "state": "running"})
    placements.deleted("b")
    assert placements.holding() == {"n1", "n2"}
    assert placements.lose("n2", "gone") == 1 and placements.lose("n2", "gone") == 0
    assert [p.sandbox_id for p in placements.lost("acme")] == ["c"]
    assert placements.holding() == {"n1"}
    gone = placements.get("c")
    assert gone is not None and gone.shown()["state"] == "lost"
    placements.resync("n2", [{"id": "c", "tenant": "acme", "state": "running"}])
    assert placements.lost() == [] and placements.holding() == {"n1", "n2"}
    deleted = placements.get("b")
    assert deleted is not None and deleted.body["state"] == "deleted"
    homes = Homes(place(where, "homes.db"))
    homes.put(Home("volume", "acme", "v1", "data", "n1"))
    homes.put(Home("volume", "acme", "v1", "data", "n2"))  # moved: replaced
    found = homes.find("volume", "acme", "data")
    assert found is not None and found.node == "n2" and homes.count_on("volume", "n2") == 1
    store = store_at(where)
    keys = Keys(store)
    grants = Delegations(place(where, "grants.db"), DaemonSettings(), placements, keys)
    grants.made("a", "acme", {"key_id": "k", "scopes": []})
    grant = grants.grant_of("a")
    assert grant is not None and grant.tenant == "acme"
    assert grants.grant_of("c") is None  # control: no grant made for it


def test_gateways_share_one_postgres_and_migrate_once(server: str) -> None:
    url = fresh_database(server, "together")
    made: list[Store] = []
    failed: list[BaseException] = []

    def start() -> None:
        try:
            made.append(Store(url))
        except BaseException as exc:
            failed.append(exc)

    threads = [threading.Thread(target=start) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failed == [] and len(made) == 4
    assert {s.schema_version for s in made} == {len(MIGRATIONS)}
    made[0].add_key("k1", "acme", "h1")
    assert made[3].key_by_hash("h1") is not None  # written by one, read by another
    a, b = Placements(url), Placements(url)
    a.put("n1", {"id": "x", "tenant": "acme", "state": "running"})
    assert b.get("x") is not None


def test_one_lease_holder_and_its_successor(server: str, tmp_path: Path) -> None:
    first, second = Lease(server, "membership"), Lease(server, "membership")
    assert first.held() and first.held()
    assert not second.held()
    other = Lease(server, "another")  # control: another name is another lease
    assert other.held()
    first.close()  # its gateway died: its session, and the lock, go (once the server sees it)
    deadline = time.monotonic() + 30
    while not second.held():  # a gateway asks at each poll
        assert time.monotonic() < deadline, "the lease was not taken over"
        time.sleep(0.1)
    for lease in (second, other):
        lease.close()
    assert Lease(tmp_path / "x.db", "membership").held()  # SQLite: one gateway, always


def test_a_postgres_url_opens_postgres_and_a_path_sqlite(server: str, tmp_path: Path) -> None:
    assert open_database(server).dialect == "postgres"
    assert open_database(tmp_path / "x.db").dialect == "sqlite"


async def test_a_key_claimed_at_a_live_gateway_is_waited_for(server: str) -> None:
    """A create retried at gateway b while gateway a still makes it gets a's sandbox; one
    retried after a died (its presence gone) is made again at b."""
    url = fresh_database(server, "keys")
    a, b = Presence(url), Presence(url)
    a.hold()
    b.hold()
    at_a = Idempotency(Store(url), owner=a.id, alive=a.alive)
    at_b = Idempotency(Store(url), owner=b.id, alive=b.alive)
    release = asyncio.Event()
    made_at_b: list[str] = []

    async def slow() -> list[str]:
        await release.wait()
        return ["sb-a"]

    async def at_b_work() -> list[str]:
        made_at_b.append("sb-b")
        return ["sb-b"]

    first = asyncio.create_task(at_a.once("acme", "create", "k1", {"x": 1}, slow))
    await asyncio.sleep(0.2)  # a has claimed the key
    retry = asyncio.create_task(at_b.once("acme", "create", "k1", {"x": 1}, at_b_work))
    await asyncio.sleep(1.0)
    assert not retry.done()  # waits for a, which lives
    release.set()
    assert await first == ["sb-a"] and await retry == ["sb-a"] and made_at_b == []

    # a claims another key and dies during it: b makes it
    stuck = asyncio.create_task(at_a.once("acme", "create", "k2", {"x": 2}, asyncio.Event().wait))
    await asyncio.sleep(0.2)
    retry = asyncio.create_task(at_b.once("acme", "create", "k2", {"x": 2}, at_b_work))
    await asyncio.sleep(1.0)
    assert not retry.done()
    a.close()  # gateway a is gone
    assert await asyncio.wait_for(retry, 60) == ["sb-b"] and made_at_b == ["sb-b"]
    stuck.cancel()
    b.close()
