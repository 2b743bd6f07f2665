"""Which node is the home of a tenant's volume or named template (SQLite).

A volume's files and a named template's builds live on the node they were made on; the
gateway records the node here when it makes them, and when it finds one on a node that it
had not recorded (a gateway whose table was lost asks the nodes again), so calls on them go
to that node.
"""

from __future__ import annotations

import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS homes (
    kind TEXT NOT NULL,
    tenant TEXT NOT NULL,
    id TEXT NOT NULL,
    name TEXT NOT NULL,
    node TEXT NOT NULL,
    PRIMARY KEY (kind, id)
);
CREATE INDEX IF NOT EXISTS homes_name ON homes (kind, tenant, name);
"""


@dataclass(frozen=True, slots=True)
class Home:
    kind: str  # "volume" or "template"
    tenant: str
    id: str
    name: str
    node: str


class Homes:
    def __init__(self, path: Path) -> None:
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(SCHEMA)

    def put(self, home: Home) -> None:
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO homes VALUES (?, ?, ?, ?, ?)",
                (home.kind, home.tenant, home.id, home.name, home.node),
            )

    def find(self, kind: str, tenant: str, key: str) -> Home | None:
        """The tenant's `kind` whose id or name is `key`."""
        with self._lock:
            row = self._db.execute(
                "SELECT kind, tenant, id, name, node FROM homes WHERE kind = ? AND tenant = ? "
                "AND (id = ? OR name = ?) ORDER BY id = ? DESC LIMIT 1",
                (kind, tenant, key, key, key),
            ).fetchone()
        return Home(*row) if row else None

    def by_id(self, kind: str, id_: str) -> Home | None:
        with self._lock:
            row = self._db.execute(
                "SELECT kind, tenant, id, name, node FROM homes WHERE kind = ? AND id = ?",
                (kind, id_),
            ).fetchone()
        return Home(*row) if row else None

    def of_tenant(self, kind: str, tenant: str) -> list[Home]:
        with self._lock:
            rows = self._db.execute(
                "SELECT kind, tenant, id, name, node FROM homes WHERE kind = ? AND tenant = ?",
                (kind, tenant),
            ).fetchall()
        return [Home(*r) for r in rows]

    def count_on(self, kind: str, node: str) -> int:
        with self._lock:
            row = self._db.execute(
                "SELECT count(*) FROM homes WHERE kind = ? AND node = ?", (kind, node)
            ).fetchone()
        return int(row[0])

    def forget(self, kind: str, id_: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM homes WHERE kind = ? AND id = ?", (kind, id_))
