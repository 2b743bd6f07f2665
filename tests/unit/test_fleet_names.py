"""A fleet gateway names sandboxes as a node does (`cella.policy.access`): a create's name
clashes only with the creator's own sandboxes and those the tenant sees, and a name means
the caller's own, else the tenant's, else the only other one it sees. The nodes' answers
are stand-ins here; the node's own rule runs in tests/unit/test_access.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest

from cella import errors
from cella.fleet.locator import Locator
from cella.fleet.membership import Membership
from cella.fleet.placement_table import Placements
from cella.fleet.quotas import Quotas
from cella.policy.access import Principal, Role

MEMBER, OWNER = frozenset({Role.member}), frozenset({Role.owner})
ALICE = Principal("t", False, False, "key-a", "alice", MEMBER)
BOB = Principal("t", False, False, "key-b", "bob", MEMBER)
CAROL = Principal("t", False, False, "key-c", "carol", OWNER)


def box(sandbox_id: str, creator: str, visibility: str = "private") -> dict[str, Any]:
    return {"id": sandbox_id, "tenant": "t", "name": "x", "state": "running",
            "creator": creator, "visibility": visibility, "shares": {}, "labels": {}}  # fmt: skip


class Node:
    """A node's answer to the gateway's list of a tenant's sandboxes."""

    def __init__(self, boxes: list[dict[str, Any]]) -> None:
        self.boxes = boxes

    async def json(self, method: str, path: str, who: Principal, **kw: Any) -> Any:
        return {"sandboxes": self.boxes}


class Nodes:
    """One node's answer to a list, as the caller may see it."""

    def __init__(self, boxes: list[dict[str, Any]]) -> None:
        self.boxes = boxes

    def healthy(self) -> list[Any]:
        return []

    def up(self, name: str) -> Node:
        return Node(self.boxes)

    async def each(self, method: str, path: str, who: Principal, **kw: Any) -> list[Any]:
        from cella.fleet.locator import visible

        return [(object(), {"sandboxes": [b for b in self.boxes if visible(who, b)]})]


async def admit(quotas: Quotas, who: Principal, name: str) -> None:
    async with quotas.admitted(who, 1, name):
        pass


def quotas_over(tmp_path: Path, boxes: list[dict[str, Any]]) -> Quotas:
    """A gateway's quotas, its records and the node's answers holding `boxes`."""
    placements = Placements(tmp_path / f"p{len(list(tmp_path.iterdir()))}.db")
    for b in boxes:
        placements.put("n1", b)
    return Quotas(placements, cast(Membership, Nodes(boxes)), 10)


async def test_a_create_is_refused_only_for_a_name_it_may_know(tmp_path: Path) -> None:
    quotas = quotas_over(tmp_path, [box("a", "alice")])
    await admit(quotas, BOB, "x")  # alice's private one is not his to know
    with pytest.raises(errors.AlreadyExists, match="in use"):
        await admit(quotas, ALICE, "x")  # her own
    shown = quotas_over(tmp_path, [box("a", "alice", "tenant")])
    with pytest.raises(errors.AlreadyExists, match="in use"):
        await admit(shown, BOB, "x")  # the tenant's: he sees it
    await admit(shown, BOB, "y")  # the control: another name


async def test_a_name_means_what_it_means_on_a_node(tmp_path: Path) -> None:
    placements = Placements(tmp_path / "p.db")
    placements.resync("n1", [box("a", "alice"), box("b", "bob")])
    locator = Locator(cast(Membership, Nodes([])), placements)
    assert (await locator.placement_named(ALICE, "x")).sandbox_id == "a"
    assert (await locator.placement_named(BOB, "x")).sandbox_id == "b"
    with pytest.raises(errors.Conflict, match="address one by its id"):
        await locator.placement_named(CAROL, "x")  # an owner sees both, made neither
    placements.put("n1", box("b", "bob", "tenant"))
    assert (await locator.placement_named(CAROL, "x")).sandbox_id == "b"  # the tenant's
    with pytest.raises(errors.NotFound):
        await locator.placement_named(BOB, "nothing")
