"""The gateway's record of replicas (SQLite) and its moves' volume rule, with stand-ins
for the nodes (on a real fleet: tests/fleet/replica_checks.py, tests/fleet/move_checks.py)."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from cella import errors
from cella.config import DaemonSettings
from cella.fleet.homes import Home
from cella.fleet.moves import FleetMoves
from cella.fleet.replicas import Replicas
from tests.unit.test_fleet_records import replicas as records
from tests.unit.test_shared_state import place, server, where  # noqa: F401  (fixtures)

OLD_SCHEMA = """CREATE TABLE replicas (sandbox_id TEXT PRIMARY KEY, tenant TEXT NOT NULL,
node TEXT, snapshot_id TEXT, taken_at REAL, size_bytes INTEGER, error TEXT, export TEXT)"""


def replicas(path: Path) -> Replicas:
    settings = DaemonSettings(data_dir=path.parent, replica_interval_s=5)
    none: Any = SimpleNamespace(placements=None)  # nothing of the fleet is asked here
    return Replicas(path, settings, none, none, none, none)


def test_a_replica_record_says_what_the_copy_holds(tmp_path: Path) -> None:
    """A record written before memory was kept gains its columns; a copy's memory, pause
    and the option are shown; a sandbox `recovered` paused stays so until it runs."""
    db = sqlite3.connect(tmp_path / "replicas.db")
    db.execute(OLD_SCHEMA)
    db.execute("INSERT INTO replicas (sandbox_id, tenant) VALUES ('sb-old', 't')")
    db.commit()
    db.close()
    r = replicas(tmp_path / "replicas.db")
    old = r.of("sb-old")
    assert not old.memory and not old.replicate_memory and old.paused_ms is None
    r.add("sb-live", "t")
    assert not r.of("sb-live").replicate_memory
    r.keep_memory("sb-live")
    assert r.of("sb-live").replicate_memory
    r._set("sb-live", node="n2", taken_at=1.0, state="paused", paused_ms=12.5)
    shown = r.of("sb-live")
    assert shown.memory and shown.paused_ms == 12.5 and shown.node == "n2"
    body = {"id": "sb-live", "state": "paused"}
    assert r.shown(body) == {**body, "replicate": True, "replicate_memory": True}
    assert r.shown({"id": "sb-other", "state": "running"}) == {"id": "sb-other", "state": "running"}

    note = {"from_node": "n1", "state": "paused"}
    r._db.execute("INSERT INTO recoveries VALUES (?, ?)", ("sb-live", json.dumps(note)))
    back = r.shown(body)
    assert back["state"] == "recovered" and back["recovery"] == note
    assert r.shown({"id": "sb-live", "state": "running"})["state"] == "running"  # resumed
    assert r.shown(body)["state"] == "paused"  # and recovered no longer

    # a pause or stop the gateway did not see is copied once; a copy of it, not again
    assert r._held_since("sb-old", {"state": "paused"})  # never copied
    r._set("sb-old", taken_at=100.0, state="stopped")
    assert r._held_since("sb-old", {"state": "paused"})  # its copy is of it not paused
    r._set("sb-old", state="paused")
    paused = {"state": "paused", "updated_at": "1970-01-01T00:01:00+00:00"}
    assert not r._held_since("sb-old", paused)  # paused before the copy (at 60 s)
    assert r._held_since("sb-old", {**paused, "updated_at": "1970-01-01T00:02:00+00:00"})
    stopped = {"state": "stopped", "stopped_at": "1970-01-01T00:01:00+00:00"}
    assert not r._held_since("sb-old", stopped)
    assert not r._held_since("sb-old", {"state": "running"})


class StandIns:
    """Nodes and volumes' homes as `FleetMoves` asks for them."""

    def __init__(self, up: set[str], homes: dict[str, str]) -> None:
        self.up_nodes = up
        self.homes = homes  # volume id -> its node
        self.lent: list[tuple[str, list[Any]]] = []

    def up(self, name: str) -> Any:
        return SimpleNamespace(name=name) if name in self.up_nodes else None

    async def find(self, who: Any, key: str) -> Home | None:
        node = self.homes.get(key)
        return None if node is None else Home("volume", who.tenant, key, f"name-{key}", node)

    async def lend(self, who: Any, node: Any, mounts: list[Any]) -> None:
        self.lent.append((node.name, mounts))


async def test_a_moving_sandboxs_volumes_must_stay_reachable() -> None:
    """Lent to the destination when their homes are up and not being drained; otherwise
    refused, naming the volume and why (the control: no volumes, nothing asked)."""
    fake = StandIns(up={"n1", "n2", "n3"}, homes={"vol-a": "n2", "vol-b": "n1"})
    moves = FleetMoves(fake, None, None, None, None, fake)  # type: ignore[arg-type]
    dest: Any = SimpleNamespace(name="n3")

    def sandbox(*volumes: str) -> dict[str, Any]:
        mounts = [{"volume": v, "path": f"/mnt/{v}"} for v in volumes]
        return {"id": "sb-1", "tenant": "t", "volume_mounts": mounts}

    await moves._volumes_reach(sandbox("vol-a"), dest, draining="n1")
    assert fake.lent == [("n3", sandbox("vol-a")["volume_mounts"])]
    await moves._volumes_reach(sandbox("vol-b"), dest)  # a move off its home: it is up
    with pytest.raises(errors.InvalidState, match="name-vol-b, which lives on node n1"):
        await moves._volumes_reach(sandbox("vol-a", "vol-b"), dest, draining="n1")
    fake.up_nodes.discard("n2")
    with pytest.raises(errors.InvalidState, match="node n2 is down"):
        await moves._volumes_reach(sandbox("vol-a"), dest)
    with pytest.raises(errors.InvalidState, match="vol-x, which no node holds"):
        await moves._volumes_reach(sandbox("vol-x"), dest)
    lent = len(fake.lent)
    await moves._volumes_reach({"id": "sb-2", "tenant": "t"}, dest, draining="n1")
    assert len(fake.lent) == lent == 2


def test_what_a_copy_holds_is_known_to_every_gateway(where: str) -> None:  # noqa: F811
    """On both backends (SQLite, a shared PostgreSQL): the memory option and what the
    copy holds, written through one gateway, read through another."""
    a, b = records(place(where, "replicas.db")), records(place(where, "replicas.db"))
    a.add("sb-m", "t")
    a.keep_memory("sb-m")
    a._set("sb-m", node="n3", taken_at=time.time(), state="paused", paused_ms=4.0)
    seen = b.of("sb-m")
    assert seen.replicate_memory and seen.memory and seen.paused_ms == 4.0
    b.add("sb-d", "t")  # the control: a replica of its disk alone
    b._set("sb-d", node="n3", taken_at=time.time(), state="stopped")
    assert not a.of("sb-d").memory and not a.of("sb-d").replicate_memory
