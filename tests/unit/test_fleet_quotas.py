"""A tenant's quota across the fleet, counted from the gateway's placement records (on both
backends): a create asks no node; creates made at once hold their share until recorded; a
lost node's sandboxes do not count and a recovered one does once it runs; records that say
too much (a node stopped or deleted a sandbox on its own) are confirmed with the nodes that
hold them before a create is refused. The nodes are stand-ins answering a tenant's list."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from cella import errors
from cella.fleet.holds import Holds
from cella.fleet.membership import Membership
from cella.fleet.placement_table import Placements
from cella.fleet.quotas import Quotas
from cella.service.keys import Principal
from tests.postgres import fresh_database
from tests.unit.test_shared_state import NAMES, place, server, where  # noqa: F401

LIMIT = 3
ACME = Principal.service("acme")


def box(sandbox_id: str, state: str = "running", **more: Any) -> dict[str, Any]:
    return {"id": sandbox_id, "tenant": "acme", "state": state, **more}


class Node:
    def __init__(self, name: str, fleet: Fleet) -> None:
        self.name, self.fleet = name, fleet

    async def json(self, method: str, path: str, who: Principal, **kw: Any) -> Any:
        assert (method, path) == ("GET", "/v1/sandboxes") and who.tenant == "acme"
        self.fleet.asked.append(self.name)
        return {"sandboxes": list(self.fleet.truth.get(self.name, {}).values())}


class Fleet:
    """The nodes' own view (`truth`: node -> sandboxes), asked only through `up`."""

    def __init__(self) -> None:
        self.truth: dict[str, dict[str, dict[str, Any]]] = {}
        self.asked: list[str] = []
        self.down: set[str] = set()

    def has(self, node: str, *bodies: dict[str, Any]) -> None:
        for b in bodies:
            self.truth.setdefault(node, {})[b["id"]] = b

    def up(self, name: str) -> Node | None:
        return None if name in self.down else Node(name, self)


def gateway(where: str) -> tuple[Quotas, Placements, Fleet]:  # noqa: F811
    placements = Placements(place(where, "placements.db"))
    fleet = Fleet()
    return Quotas(placements, cast(Membership, fleet), LIMIT), placements, fleet


async def made(quotas: Quotas, placements: Placements, fleet: Fleet, node: str, sid: str) -> None:
    """One create as the launcher runs it: admitted, made on its node, recorded."""
    async with quotas.admitted(ACME, 1) as hold:
        fleet.has(node, box(sid))
        placements.put(node, box(sid))
        hold.placed(1)


async def test_a_create_is_counted_from_the_records_asking_no_node(where: str) -> None:  # noqa: F811
    quotas, placements, fleet = gateway(where)
    await made(quotas, placements, fleet, "n1", "a")
    await made(quotas, placements, fleet, "n2", "b")
    fleet.has("n1", box("s", "stopped"), box("w", "stopped", auto_resume=True))
    placements.put("n1", box("s", "stopped"))  # does not count
    placements.put("n1", box("w", "stopped", auto_resume=True))  # wakes by itself: counts
    placements.put("n3", box("other", tenant="initech"))  # another tenant's
    assert quotas.live("acme") == 3 and fleet.asked == []
    with pytest.raises(errors.QuotaExceeded, match="has 3 live sandboxes"):
        await made(quotas, placements, fleet, "n1", "c")
    assert sorted(fleet.asked) == ["n1", "n2"]  # the refusal confirmed, by those nodes only
    fleet.asked.clear()
    placements.deleted("a")  # deleted through the gateway: room again, no node asked
    await made(quotas, placements, fleet, "n2", "c")
    assert fleet.asked == []


async def test_creates_at_once_hold_their_share_until_recorded(where: str) -> None:  # noqa: F811
    quotas, placements, fleet = gateway(where)
    await made(quotas, placements, fleet, "n1", "a")
    release = asyncio.Event()

    async def slow(sid: str) -> str:
        async with quotas.admitted(ACME, 1) as hold:
            await release.wait()  # its node is making it
            placements.put("n2", box(sid))
            fleet.has("n2", box(sid))
            hold.placed(1)
            await asyncio.sleep(0)  # recorded, not yet out of admission: counted once
        return sid

    tasks = [asyncio.create_task(slow(f"s{i}")) for i in range(4)]
    await asyncio.sleep(0.05)
    release.set()
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    done = [o for o in outcomes if isinstance(o, str)]
    refused = [o for o in outcomes if isinstance(o, errors.QuotaExceeded)]
    assert len(done) == 2 and len(refused) == 2, outcomes  # 1 live + 2 = the limit
    assert "being made" in str(refused[0])
    assert quotas.live("acme") == LIMIT and quotas.holds.making("acme") == 0


async def test_a_lost_node_does_not_count_and_a_recovered_sandbox_does(where: str) -> None:  # noqa: F811
    quotas, placements, fleet = gateway(where)
    for sid in ("a", "b", "c"):
        await made(quotas, placements, fleet, "n1", sid)
    assert placements.lose("n1", "node n1 died") == 3
    fleet.down.add("n1")
    assert quotas.live("acme") == 0
    await made(quotas, placements, fleet, "n2", "d")  # room: the lost ones count no more
    placements.put("n3", box("a", "stopped"))  # recovered from its replica: stopped
    fleet.has("n3", box("a", "stopped"))
    assert quotas.live("acme") == 1
    placements.set_state("a", "starting")  # resumed through the gateway
    fleet.has("n3", box("a", "running"))
    assert quotas.live("acme") == 2
    await made(quotas, placements, fleet, "n2", "e")
    with pytest.raises(errors.QuotaExceeded):
        await made(quotas, placements, fleet, "n2", "f")


async def test_records_that_say_too_much_are_confirmed_before_a_refusal(
    where: str,  # noqa: F811
) -> None:
    quotas, placements, fleet = gateway(where)
    for sid in ("a", "b", "c"):
        await made(quotas, placements, fleet, "n1" if sid != "c" else "n2", sid)
    fleet.has("n1", box("a", "stopped"))  # its idle timeout, on the node
    del fleet.truth["n2"]["c"]  # its TTL: deleted there
    await made(quotas, placements, fleet, "n1", "d")  # asked, then admitted
    assert sorted(fleet.asked) == ["n1", "n2"]
    shown = placements.get("c")
    assert shown is not None and shown.body["state"] == "deleted"
    assert quotas.live("acme") == 2  # b and d
    fleet.asked.clear()
    fleet.down.add("n1")  # a node that is down keeps its records counted
    fleet.has("n1", box("b", "stopped"))
    await made(quotas, placements, fleet, "n2", "e")
    with pytest.raises(errors.QuotaExceeded):
        await made(quotas, placements, fleet, "n2", "f")
    assert fleet.asked == ["n2"]


async def test_a_name_is_taken_by_a_record_unless_its_node_deleted_it(where: str) -> None:  # noqa: F811
    quotas, placements, fleet = gateway(where)
    placements.put("n1", box("a", name="web"))
    fleet.has("n1", box("a", name="web"))
    with pytest.raises(errors.AlreadyExists, match="in use"):
        async with quotas.admitted(ACME, 1, "web"):
            pass
    async with quotas.admitted(ACME, 1, "api"):  # the control: another name
        pass
    del fleet.truth["n1"]["a"]  # gone on its node
    async with quotas.admitted(ACME, 1, "web"):
        pass
    placements.put("n2", box("b", name="db"))
    placements.lose("n2", "gone")
    async with quotas.admitted(ACME, 1, "db"):  # a lost sandbox's name is free
        pass


async def test_two_gateways_hold_one_tenants_limit_together(server: str) -> None:  # noqa: F811
    """Two gateways sharing PostgreSQL: what one is making counts at the other while that
    one lives; once it is gone, its holds are dropped."""
    url = fresh_database(server, f"q{next(NAMES)}")
    living = {"a", "b"}
    fleet = Fleet()

    def gateway_of(owner: str) -> tuple[Quotas, Placements]:
        placements = Placements(url)
        holds = Holds(placements.db, owner, lambda other: other in living)
        return Quotas(placements, cast(Membership, fleet), LIMIT, holds), placements

    (a, at_a), (b, _) = gateway_of("a"), gateway_of("b")
    await made(a, at_a, fleet, "n1", "x")
    async with a.admitted(ACME, 2, "web"):  # a is making two, one named
        with pytest.raises(errors.QuotaExceeded, match="2 being made"):
            async with b.admitted(ACME, 1):
                pass
        with pytest.raises(errors.AlreadyExists, match="being made"):
            async with b.admitted(ACME, 0, "web"):
                pass
        living.discard("a")  # gateway a died while it made them
        async with b.admitted(ACME, 1):  # its holds are dropped: room
            pass
