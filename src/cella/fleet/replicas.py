"""Replicas: a copy of a replicated sandbox's disk (and its last memory) kept on a second
node, so that the sandbox outlives its node.

A sandbox is replicated when it was made with `replicate: true` (or `replicate_memory`),
or its tenant is one of the gateway's `replicate_tenants`. Its replica is taken by its node
(`POST /v1/sandboxes/{id}/replica`: a snapshot with the sandbox's row, as a move exports
it), shipped to another node the planner picks (the files copied over, checked against
their manifest: it shares nothing with the original), then removed from the sandbox's own
node; the copy before it is removed from its node once the new one is in. It is refreshed
when the sandbox is stopped or paused through the gateway (right after), every
`replica_interval_s` while it runs, and once after a stop or pause the gateway did not see
(its idle timeout, its TTL). What it holds follows the sandbox: a paused one's copy has its
disk and memory; a running one's its disk alone (the guest's writes synced first), or with
`replicate_memory` its memory too (a live snapshot: the guest pauses for the copy, which
the record shows as `paused_ms`); a stopped one's its disk. The gateway records each
replica (node, taken at, size, memory, the export) in its database (SQLite, or the
gateways' shared PostgreSQL: a replica recorded through one gateway is known to all), and
one gateway at a time refreshes a given replica (an advisory lock named after the sandbox;
the period runs on the holder of the `replicas` lease).

When a node is lost, each replicated sandbox of it whose replica is on a node that is up
is taken in there as a move's destination takes a sandbox in (`POST
/v1/sandboxes/recover`, with the export kept here): same id, its files the replica's,
paused when the copy has memory (its processes go on at resume) and stopped otherwise,
with a `recovered` event naming the replica's age and the state. The gateway shows it as
`recovered` (with `recovery`: from which node, how old the replica was, as what) until it
is resumed; unreplicated sandboxes stay `lost`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sqlite3
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cella import errors
from cella.config import DaemonSettings
from cella.fleet.locator import Locator
from cella.fleet.membership import Membership
from cella.fleet.node_client import Node
from cella.fleet.planner import Planner, Shape
from cella.fleet.snapshots import FleetSnapshots
from cella.models.fleet import Replica
from cella.service.keys import Principal
from cella.service.periodic import Periodic
from cella.service.replicas import replica_name
from cella.store.sql import Database, Lease, Locks, database

log = logging.getLogger("cella.fleet.replicas")
TICK_SECONDS = 1.0
LOCK_POLL_SECONDS = 0.5  # how often a refresh asks again for a replica another one holds
Json = dict[str, Any]

SCHEMA = """
CREATE TABLE IF NOT EXISTS replicas (
    sandbox_id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    node TEXT,
    snapshot_id TEXT,
    taken_at REAL,
    size_bytes INTEGER,
    error TEXT,
    export TEXT
);
CREATE TABLE IF NOT EXISTS replica_snapshots (snapshot_id TEXT PRIMARY KEY);
CREATE TABLE IF NOT EXISTS recoveries (sandbox_id TEXT PRIMARY KEY, note TEXT NOT NULL);
"""
# what a replica holds: the option (memory of a running sandbox too), the copy's state
# (paused: it has memory) and the running guest's pause for it
MEMORY = """
ALTER TABLE replicas ADD COLUMN memory INTEGER NOT NULL DEFAULT 0;
ALTER TABLE replicas ADD COLUMN state TEXT;
ALTER TABLE replicas ADD COLUMN paused_ms REAL;
"""
MIGRATIONS = (SCHEMA, MEMORY)
# the tables an older gateway's own file held, and their columns then
TABLES = {
    "replicas": "sandbox_id, tenant, node, snapshot_id, taken_at, size_bytes, error, export",
    "replica_snapshots": "snapshot_id",
    "recoveries": "sandbox_id, note",
}


def take_in(db: Database, legacy: Path) -> None:
    """The records an older gateway kept in a file of its own (`replicas.db`), copied
    into the gateway's database once; the file is renamed so that it is not read again."""
    old = sqlite3.connect(legacy)
    try:
        old.executescript(SCHEMA)  # a table it never made is read as empty
        with db.transaction():
            for table, columns in TABLES.items():
                rows = old.execute(f"SELECT {columns} FROM {table}").fetchall()
                marks = ", ".join("?" * len(columns.split(",")))
                db.executemany(f"INSERT OR IGNORE INTO {table} ({columns}) VALUES ({marks})", rows)
    finally:
        old.close()
    os.replace(legacy, legacy.with_name(legacy.name + ".migrated"))
    log.info("replica records moved from %s into the gateway's database", legacy)


def iso(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).isoformat(timespec="seconds")


class Replicas:
    def __init__(
        self,
        where: Path | str | Database,
        settings: DaemonSettings,
        membership: Membership,
        locator: Locator,
        planner: Planner,
        snapshots: FleetSnapshots,
        legacy: Path | None = None,
        locks: Locks | None = None,
        lease: Lease | None = None,
    ) -> None:
        self._db = database(where)
        self._db.migrate("replicas", MIGRATIONS)
        if legacy is not None and legacy.exists():
            take_in(self._db, legacy)
        self._locks = locks or Locks("")  # one gateway refreshes a replica at a time
        self._lease = lease or Lease("", "replicas")  # and one runs the period
        self.tenants = set(settings.replicate_tenants)
        self.interval = settings.replica_interval_s
        self.membership = membership
        self.locator = locator
        self.placements = locator.placements
        self.planner = planner
        self.snapshots = snapshots
        self._busy: dict[str, asyncio.Lock] = {}
        self._next: dict[str, float] = {}  # sandbox -> when the period next looks at it
        self._period = Periodic(
            "refreshing replicas", self.tick, lambda: min(TICK_SECONDS, self.interval), log
        )
        self._recovering = asyncio.Lock()

    # -- the record ----------------------------------------------------------------------

    def wanted(self, tenant: str, asked: bool) -> bool:
        return asked or tenant in self.tenants

    def add(self, sandbox_id: str, tenant: str) -> None:
        self._db.execute(
            "INSERT OR IGNORE INTO replicas (sandbox_id, tenant) VALUES (?, ?)",
            (sandbox_id, tenant),
        )

    def keep_memory(self, sandbox_id: str) -> None:
        """The replicated sandbox's copies keep its memory while it runs too (a live
        snapshot each period: `replicate_memory`)."""
        self._db.execute("UPDATE replicas SET memory = 1 WHERE sandbox_id = ?", (sandbox_id,))

    def replicated(self, sandbox_id: str) -> bool:
        return self._row(sandbox_id) is not None

    def hidden(self, snapshot: Json) -> bool:
        """A replica's snapshot (also one still being taken): the gateway's, not one a
        tenant took."""
        sandbox_id = str(snapshot.get("sandbox_id"))
        if snapshot.get("name") == replica_name(sandbox_id) and self.replicated(sandbox_id):
            return True
        row = self._db.execute(
            "SELECT 1 FROM replica_snapshots WHERE snapshot_id = ?", (snapshot.get("id"),)
        ).fetchone()
        return row is not None

    def of(self, sandbox_id: str) -> Replica:
        row = self._row(sandbox_id)
        if row is None:
            raise errors.NotFound(f"sandbox {sandbox_id} is not replicated (create it with "
                                  "replicate: true)")  # fmt: skip
        node, _, taken_at, size, error, memory, state, paused_ms = row
        return Replica(
            sandbox_id=sandbox_id,
            node=node,
            taken_at=datetime.fromtimestamp(taken_at, UTC) if taken_at else None,
            age_seconds=round(time.time() - taken_at, 1) if taken_at else None,
            size_bytes=size,
            memory=state == "paused",
            paused_ms=paused_ms,
            replicate_memory=bool(memory),
            error=error,
        )

    def shown(self, body: Json) -> Json:
        """A sandbox as the gateway shows it: `replicate` said, and `recovered` (with how)
        while a sandbox brought back from its replica has not been resumed."""
        sandbox_id = str(body.get("id"))
        row = self._row(sandbox_id)
        if row is None:
            return body
        body = {**body, "replicate": True, "replicate_memory": bool(row[5])}
        found = self._db.execute(
            "SELECT note FROM recoveries WHERE sandbox_id = ?", (sandbox_id,)
        ).fetchone()
        if found is None:
            return body
        note = json.loads(found[0])
        if body.get("state") != note.get("state", "stopped"):  # resumed (or deleted)
            self._db.execute("DELETE FROM recoveries WHERE sandbox_id = ?", (sandbox_id,))
            return body
        return {**body, "state": "recovered", "recovery": note}

    def _row(self, sandbox_id: str) -> tuple[Any, ...] | None:
        row = self._db.execute(
            "SELECT node, snapshot_id, taken_at, size_bytes, error, memory, state, "
            "paused_ms FROM replicas WHERE sandbox_id = ?",
            (sandbox_id,),
        ).fetchone()
        return tuple(row) if row else None

    def _export(self, sandbox_id: str) -> Json:
        found = self._db.execute(
            "SELECT export FROM replicas WHERE sandbox_id = ?", (sandbox_id,)
        ).fetchone()
        if not found or not found[0]:
            raise errors.NotFound(f"sandbox {sandbox_id} has no replica")
        export: Json = json.loads(found[0])
        return export

    def _set(self, sandbox_id: str, **fields: Any) -> None:
        sets = ", ".join(f"{k} = ?" for k in fields)
        self._db.execute(
            f"UPDATE replicas SET {sets} WHERE sandbox_id = ?", (*fields.values(), sandbox_id)
        )

    def _hide(self, snapshot_id: str) -> None:
        self._db.execute("INSERT OR IGNORE INTO replica_snapshots VALUES (?)", (snapshot_id,))

    # -- refreshing ----------------------------------------------------------------------

    async def refresh(self, sandbox_id: str, wait: bool = True) -> Replica:
        """A new replica of the sandbox: copied on its node (see the module's doc for what
        the copy holds), shipped to another, the previous copy removed. While another
        gateway refreshes it, waited for (`wait`), else left to that one."""
        name = f"replica:{sandbox_id}"
        async with self._busy.setdefault(sandbox_id, asyncio.Lock()):
            while not await asyncio.to_thread(self._locks.try_hold, name):
                if not wait:
                    return self.of(sandbox_id)
                await asyncio.sleep(LOCK_POLL_SECONDS)
            try:
                await self._refresh(sandbox_id)
            except errors.CellaError as exc:
                self._set(sandbox_id, error=f"{type(exc).__name__}: {exc}")
                raise
            finally:
                await asyncio.to_thread(self._locks.release, name)
            self._next[sandbox_id] = time.monotonic() + self.interval
        return self.of(sandbox_id)

    async def _refresh(self, sandbox_id: str) -> None:
        where = self.placements.get(sandbox_id)
        if where is None or self._row(sandbox_id) is None:
            raise errors.NotFound(f"no replicated sandbox {sandbox_id!r}")
        node = self.locator.usable(where)
        who = Principal.service(where.tenant)
        old_node, old_snapshot, *_, memory, _, _ = self._row(sandbox_id) or (None,) * 8
        export = await node.json(
            "POST",
            f"/v1/sandboxes/{sandbox_id}/replica",
            params={"memory": "true"} if memory else None,
        )
        snapshot_id, row = str(export["snapshot_id"]), export["sandbox"]
        self._hide(snapshot_id)
        with_memory = export["state"] == "paused"
        try:
            shape = Shape(int(row["vcpus"]), int(row["memory_mib"]), str(row["template"]))
            away = frozenset({node.name})  # never the sandbox's own node
            plan = await self.planner.plan(shape, 1, set(), prefer=old_node, exclude=away)
            dest = self.membership.nodes[next(iter(plan))]
            await self.snapshots.ship(snapshot_id, {node.name}, dest)
        finally:  # the sandbox's own node keeps no copy: it is the one that may be lost
            with contextlib.suppress(errors.CellaError):
                await node.json("DELETE", f"/v1/snapshots/{snapshot_id}", who)
        self._set(
            sandbox_id,
            node=dest.name,
            snapshot_id=snapshot_id,
            taken_at=time.time(),
            size_bytes=export.get("bytes"),
            error=None,
            export=json.dumps(export),
            state=export["state"],
            paused_ms=export.get("held_ms") or None,  # a running guest's pause for it
        )
        log.info("replica of %s on %s (%s, %s)", sandbox_id, dest.name, snapshot_id,
                 "disk and memory" if with_memory else "disk")  # fmt: skip
        if old_snapshot and old_node:
            await self._drop(where.tenant, old_node, old_snapshot)

    async def _drop(self, tenant: str, node_name: str, snapshot_id: str) -> None:
        node = self.membership.up(node_name)
        if node is None:
            return
        with contextlib.suppress(errors.CellaError):
            await node.json("DELETE", f"/v1/snapshots/{snapshot_id}", Principal.service(tenant))

    async def after_stop(self, sandbox_id: str) -> None:
        """A replicated sandbox just stopped or paused: its replica refreshed from it as
        the stop left it, disk (and a paused one's memory) (a failure is recorded on the
        replica; the stop stands)."""
        if not self.replicated(sandbox_id):
            return
        try:
            await self.refresh(sandbox_id)
        except errors.CellaError as exc:
            log.warning("replica of %s after its stop: %s", sandbox_id, exc)

    async def forget(self, sandbox_id: str) -> None:
        """A deleted sandbox: its replica removed, nothing more kept."""
        if not self.replicated(sandbox_id):
            return
        async with self._busy.setdefault(sandbox_id, asyncio.Lock()):  # a refresh ends first
            row = self._row(sandbox_id)
            where = self.placements.get(sandbox_id)
            if row and row[0] and row[1] and where is not None:
                await self._drop(where.tenant, row[0], row[1])
            with self._db.transaction() as db:
                db.execute("DELETE FROM replicas WHERE sandbox_id = ?", (sandbox_id,))
                db.execute("DELETE FROM recoveries WHERE sandbox_id = ?", (sandbox_id,))
        self._next.pop(sandbox_id, None)
        self._busy.pop(sandbox_id, None)

    # -- the period ----------------------------------------------------------------------

    def start(self) -> None:
        self._period.start()

    async def shutdown(self) -> None:
        await self._period.close()
        self._lease.close()
        self._locks.close()

    async def tick(self) -> None:
        """Refreshes the replica of each replicated sandbox that runs and whose period is
        up, or that was stopped or paused since its copy was taken (one the gateway did
        not see: its idle timeout, its TTL). Gateways sharing a database: the lease's
        holder."""
        if not await asyncio.to_thread(self._lease.held):
            return
        now = time.monotonic()
        ids = [r[0] for r in self._db.execute("SELECT sandbox_id FROM replicas")]
        for sandbox_id in ids:
            if self._next.setdefault(sandbox_id, now + self.interval) > now:
                continue
            self._next[sandbox_id] = now + self.interval
            where = self.placements.get(sandbox_id)
            node = self.membership.up(where.node) if where and not where.lost else None
            if node is None or where is None or where.body.get("state") == "deleted":
                continue
            try:
                shown = await node.json(
                    "GET", f"/v1/sandboxes/{sandbox_id}", Principal.service(where.tenant)
                )
                if shown["state"] == "running" or self._held_since(sandbox_id, shown):
                    await self.refresh(sandbox_id, wait=False)
            except errors.CellaError as exc:
                log.warning("replica of %s: %s", sandbox_id, exc)

    def _held_since(self, sandbox_id: str, shown: Json) -> bool:
        """Stopped or paused since the copy was taken (or the copy is not of that state:
        a pause the gateway did not see after a copy of it running)."""
        row = self._row(sandbox_id)
        if row is None or shown["state"] not in ("stopped", "paused"):
            return False
        taken_at, copied_as = row[2], row[6]
        if not taken_at or (shown["state"] == "paused" and copied_as != "paused"):
            return True
        since = shown.get("stopped_at") or shown.get("updated_at")
        return bool(since) and datetime.fromisoformat(str(since)).timestamp() > taken_at

    # -- recovery ------------------------------------------------------------------------

    async def recover(self, lost_node: str, reason: str) -> int:
        """Each replicated sandbox of the lost node whose replica is on a node that is up,
        made again there (stopped, same id); returns how many."""
        async with self._recovering:  # one loss at a time: a sandbox is taken in once
            return await self._recover_all(lost_node, reason)

    async def _recover_all(self, lost_node: str, reason: str) -> int:
        count = 0
        for placement in self.placements.on_node(lost_node):
            if placement.lost is None or placement.body.get("state") == "deleted":
                continue
            row = self._row(placement.sandbox_id)
            if row is None or not row[0] or not row[1] or row[0] == lost_node:
                continue
            node = self.membership.up(row[0])
            if node is None:
                continue
            try:
                await self._recover_on(node, lost_node, placement.sandbox_id, row[2], reason)
                count += 1
            except errors.CellaError as exc:
                log.warning("%s stays lost: %s", placement.sandbox_id, exc)
        return count

    async def _recover_on(
        self, node: Node, lost_node: str, sandbox_id: str, taken_at: float, reason: str
    ) -> None:
        export = self._export(sandbox_id)
        now = time.time()
        note = {
            "from_node": lost_node,
            "node": node.name,
            "replica_taken_at": iso(taken_at),
            "replica_age_seconds": round(now - taken_at, 1),
            "at": iso(now),
            "reason": reason,
        }
        made = await node.json(
            "POST", "/v1/sandboxes/recover", json={"export": export, "event": note}
        )
        note["state"] = "paused" if made.get("state") == "paused" else "stopped"
        self.placements.put(node.name, made)  # no longer lost: it lives there now
        self._db.execute(
            "INSERT INTO recoveries VALUES (?, ?) "
            "ON CONFLICT (sandbox_id) DO UPDATE SET note = excluded.note",
            (sandbox_id, json.dumps(note)),
        )
        # the copy is the sandbox's disk's base now: the next refresh makes a new one
        self._set(sandbox_id, node=None, snapshot_id=None, taken_at=None, size_bytes=None,
                  export=None, state=None, paused_ms=None)  # fmt: skip
        log.warning(
            "%s recovered on %s, %s, from a replica %.0f s old", sandbox_id, node.name,
            note["state"], note["replica_age_seconds"],
        )  # fmt: skip
