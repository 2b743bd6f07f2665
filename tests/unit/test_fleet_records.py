"""A gateway's cordons and replica records, the same on both backends (SQLite files of one
gateway, a real PostgreSQL server that several share): what one gateway writes the other
reads, the files an older gateway kept are taken in once, and one gateway at a time holds
a replica's refresh."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path
from typing import Any, cast

from cella.config import DaemonSettings
from cella.fleet.cordons import Cordons
from cella.fleet.locator import Locator
from cella.fleet.placement_table import Placements
from cella.fleet.replicas import SCHEMA, Replicas
from cella.store.sql import Locks
from tests.postgres import fresh_database
from tests.unit.test_shared_state import NAMES, place, server, where  # noqa: F401


def replicas(at: Path | str, legacy: Path | None = None) -> Replicas:
    """The gateway's replica records (the rooms it calls are not called here)."""
    nobody = cast(Any, None)
    placements = Placements(at if isinstance(at, str) else at.parent / "placements.db")
    return Replicas(
        at,
        DaemonSettings(),
        nobody,
        Locator(nobody, placements),
        nobody,
        nobody,
        legacy=legacy,
    )


def test_a_cordon_made_through_one_gateway_holds_at_the_other(where: str) -> None:  # noqa: F811
    a, b = Cordons(place(where, "cordons.db")), Cordons(place(where, "cordons.db"))
    a.cordon("n1")
    a.cordon("n1")  # twice is once
    assert "n1" in b and b.names() == {"n1"}
    assert "n2" not in b  # control: a node nobody cordoned
    assert b.uncordon("n1") and not a.uncordon("n1")
    assert a.names() == set() and "n1" not in a


def test_an_older_gateways_cordon_file_is_taken_in_once(where: str, tmp_path: Path) -> None:  # noqa: F811
    legacy = tmp_path / "cordoned.json"
    legacy.write_text(json.dumps(["n2", "n3"]))
    first = Cordons(place(where, "cordons.db"), legacy=legacy)
    assert first.names() == {"n2", "n3"}
    assert not legacy.exists() and (tmp_path / "cordoned.json.migrated").exists()
    first.uncordon("n3")
    again = Cordons(place(where, "cordons.db"), legacy=legacy)  # a restart: the table holds
    assert again.names() == {"n2"}


def test_a_replica_recorded_by_one_gateway_is_known_to_the_other(where: str) -> None:  # noqa: F811
    a, b = replicas(place(where, "replicas.db")), replicas(place(where, "replicas.db"))
    a.add("sb-1", "acme")
    assert b.replicated("sb-1") and not b.replicated("sb-2")
    a._set("sb-1", node="n2", snapshot_id="snap-1", taken_at=1.0, size_bytes=7)
    a._hide("snap-1")
    shown = b.of("sb-1")
    assert shown.node == "n2" and shown.size_bytes == 7
    assert b.hidden({"id": "snap-1", "sandbox_id": "sb-1"})
    assert not b.hidden({"id": "snap-2", "sandbox_id": "sb-9"})  # control: a tenant's own


def test_an_older_gateways_replica_file_is_taken_in(server: str, tmp_path: Path) -> None:  # noqa: F811
    """A gateway that kept its replicas in its own `replicas.db` and now shares PostgreSQL
    moves them there on its first start."""
    legacy = tmp_path / "replicas.db"
    old = sqlite3.connect(legacy)
    old.executescript(SCHEMA)
    export = json.dumps({"snapshot_id": "snap-1"})
    old.execute(
        "INSERT INTO replicas VALUES ('sb-1', 'acme', 'n2', 'snap-1', 5.0, 9, NULL, ?)",
        (export,),
    )
    old.execute("INSERT INTO replica_snapshots VALUES ('snap-1')")
    old.execute("INSERT INTO recoveries VALUES ('sb-0', '{\"node\": \"n3\"}')")
    old.commit()
    old.close()
    url = fresh_database(server, f"r{next(NAMES)}")
    taken = replicas(url, legacy=legacy)
    assert taken.of("sb-1").node == "n2" and taken._export("sb-1") == {"snapshot_id": "snap-1"}
    assert taken.hidden({"id": "snap-1"})
    assert not legacy.exists() and (tmp_path / "replicas.db.migrated").exists()
    other = replicas(url)  # another gateway of the fleet sees them
    assert other.replicated("sb-1") and not other.replicated("sb-0")


def test_one_gateway_at_a_time_refreshes_a_replica(server: str, tmp_path: Path) -> None:  # noqa: F811
    a, b = Locks(server), Locks(server)
    assert a.try_hold("replica:sb-1")
    assert not b.try_hold("replica:sb-1")
    assert b.try_hold("replica:sb-2")  # control: another sandbox's is free
    a.release("replica:sb-1")
    assert b.try_hold("replica:sb-1")
    b.close()  # a gateway that dies lets its locks go (once the server sees it)
    deadline = time.monotonic() + 30
    while not a.try_hold("replica:sb-2"):
        assert time.monotonic() < deadline, "a dead session's lock was kept"
        time.sleep(0.1)
    assert a.try_hold("replica:sb-1")
    a.close()
    alone = Locks(tmp_path / "x.db")  # SQLite: one gateway, always granted
    assert alone.try_hold("replica:sb-1") and alone.try_hold("replica:sb-1")


async def test_a_replica_another_gateway_refreshes_is_left_to_it(server: str) -> None:  # noqa: F811
    """The period's refresh of a replica another gateway is refreshing is skipped (asked,
    it waits for that one); control: once let go, it is refreshed here."""
    url = fresh_database(server, f"r{next(NAMES)}")
    here = replicas(url)
    here._locks = Locks(url)
    here.add("sb-1", "acme")
    refreshed: list[str] = []

    async def refresh(sandbox_id: str) -> None:
        refreshed.append(sandbox_id)

    here._refresh = refresh  # type: ignore[method-assign]
    other = Locks(url)
    assert other.try_hold("replica:sb-1")  # the other gateway is refreshing it
    assert (await here.refresh("sb-1", wait=False)).sandbox_id == "sb-1"
    assert refreshed == []
    other.release("replica:sb-1")
    await here.refresh("sb-1", wait=False)
    assert refreshed == ["sb-1"]
    assert other.try_hold("replica:sb-1")  # let go here once done
    other.close()
    here._locks.close()
