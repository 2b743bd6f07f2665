"""The gateway's record of which node holds which sandbox (SQLite)."""

from __future__ import annotations

from pathlib import Path

from cella.fleet.placement_table import Placements


def body(sandbox_id: str, tenant: str = "acme", state: str = "running") -> dict[str, object]:
    return {"id": sandbox_id, "tenant": tenant, "state": state, "labels": {}}


def test_a_lost_node_makes_its_sandboxes_lost_and_a_return_heals_them(tmp_path: Path) -> None:
    p = Placements(tmp_path / "p.db")
    p.resync("n1", [body("a"), body("b")])
    p.resync("n2", [body("c")])
    assert p.lose("n1", "node n1 died") == 2
    lost = p.lost("acme")
    assert sorted(x.sandbox_id for x in lost) == ["a", "b"]
    assert all(x.shown()["state"] == "lost" and x.shown()["error"] == "node n1 died" for x in lost)
    assert p.get("c") is not None and p.get("c").lost is None  # type: ignore[union-attr]
    # survives a restart of the gateway
    again = Placements(tmp_path / "p.db")
    assert sorted(x.sandbox_id for x in again.lost()) == ["a", "b"]
    # the node comes back with one of them: that one is live, the other forgotten
    again.resync("n1", [body("a")])
    assert again.lost() == []
    assert again.get("a").lost is None  # type: ignore[union-attr]
    assert again.get("b") is None


def test_deleted_sandboxes_stay_routable_but_are_never_lost_or_listed(tmp_path: Path) -> None:
    p = Placements(tmp_path / "p.db")
    p.resync("n1", [body("a"), body("b")])
    p.deleted("a")
    assert p.get("a").body["state"] == "deleted"  # type: ignore[union-attr]
    p.resync("n1", [body("b")])  # the node no longer lists it: still known (its trace)
    assert p.get("a") is not None
    p.lose("n1", "gone")
    assert [x.sandbox_id for x in p.lost()] == ["b"]
    assert [x.sandbox_id for x in p.lost("other")] == []


def test_a_returning_node_does_not_take_back_a_sandbox_recovered_elsewhere(
    tmp_path: Path,
) -> None:
    p = Placements(tmp_path / "p.db")
    p.resync("n1", [body("a"), body("b")])
    p.lose("n1", "node n1 died")
    p.put("n2", body("a", state="stopped"))  # brought back on n2 from its replica
    older = p.resync("n1", [body("a"), body("b")])  # n1 returns with its older copy of a
    assert [b["id"] for b in older] == ["a"]  # the one to stop there
    assert p.get("a").node == "n2" and p.get("a").lost is None  # type: ignore[union-attr]
    assert p.get("b").node == "n1" and p.get("b").lost is None  # type: ignore[union-attr]
