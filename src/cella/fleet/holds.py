"""What the gateways are making for each tenant right now: a create's share of its tenant's
quota (and its name) from admission until its node has made it and it is recorded, kept
where every gateway of the fleet sees it (SQLite for one gateway, the shared PostgreSQL for
several), so that creates at two gateways at once cannot pass the limit together.

Admissions of one tenant are taken one at a time across the gateways (`locked`: an advisory
lock held by the transaction on PostgreSQL; SQLite's write lock for one gateway). A hold
names the gateway that took it: the holds of a gateway that is gone (its `Presence` let go)
are dropped, and one gateway alone drops what its last run left behind when it starts.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from cella.store.sql import Database, database, lock_key

SCHEMA = """
CREATE TABLE IF NOT EXISTS quota_holds (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    count INTEGER NOT NULL,
    creator TEXT NOT NULL,
    name TEXT NOT NULL,
    owner TEXT NOT NULL,
    at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS quota_holds_tenant ON quota_holds (tenant);
"""


class Holds:
    def __init__(
        self,
        where: Path | str | Database,
        owner: str | None = None,
        alive: Callable[[str], bool] = lambda _: False,
    ) -> None:
        self._db = database(where)
        self._db.ensure("quota_holds", SCHEMA)
        self.owner = owner or uuid.uuid4().hex  # this gateway (its presence's id)
        self.alive = alive  # whether another gateway still lives
        if self._db.dialect == "sqlite":  # one gateway: what is held was its last run's
            self._db.execute("DELETE FROM quota_holds")

    @contextlib.contextmanager
    def locked(self, tenant: str) -> Iterator[None]:
        """The tenant's admissions, one at a time across the gateways."""
        with self._db.transaction() as db:
            if db.dialect == "postgres":
                db.execute("SELECT pg_advisory_xact_lock(?)", (lock_key(f"quota:{tenant}"),))
            yield

    def making(self, tenant: str) -> int:
        """How many of the tenant's sandboxes the gateways are making (call it `locked`)."""
        rows = self._db.execute(
            "SELECT id, count, owner FROM quota_holds WHERE tenant = ?", (tenant,)
        ).fetchall()
        total = 0
        for hold_id, count, owner in rows:
            if owner == self.owner or self.alive(owner):
                total += int(count)
            else:  # its gateway is gone, and its create with it
                self._db.execute("DELETE FROM quota_holds WHERE id = ?", (hold_id,))
        return total

    def naming(self, tenant: str, creator: str, name: str) -> bool:
        """Whether a sandbox of this name is being made for the same creator."""
        row = self._db.execute(
            "SELECT owner FROM quota_holds WHERE tenant = ? AND creator = ? AND name = ?",
            (tenant, creator, name),
        ).fetchone()
        return row is not None and (row[0] == self.owner or self.alive(row[0]))

    def take(self, tenant: str, count: int, creator: str = "", name: str = "") -> str:
        hold_id = uuid.uuid4().hex
        self._db.execute(
            "INSERT INTO quota_holds VALUES (?, ?, ?, ?, ?, ?, ?)",
            (hold_id, tenant, count, creator, name, self.owner, time.time()),
        )
        return hold_id

    def placed(self, hold_id: str, count: int) -> None:
        """`count` of the hold's sandboxes are recorded now (counted from there)."""
        self._db.execute("UPDATE quota_holds SET count = count - ? WHERE id = ?", (count, hold_id))

    def drop(self, hold_id: str) -> None:
        self._db.execute("DELETE FROM quota_holds WHERE id = ?", (hold_id,))
