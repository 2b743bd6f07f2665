"""Which node is the home of a tenant's volume or named template (SQLite, or the gateways'
shared PostgreSQL).

A volume's files and a named template's builds live on the node they were made on; the
gateway records the node here when it makes them, and when it finds one on a node that it
had not recorded (a gateway whose table was lost asks the nodes again), so calls on them go
to that node.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cella.store.sql import Database, database

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
    def __init__(self, where: Path | str | Database) -> None:
        self._db = database(where)
        self._db.ensure("homes", SCHEMA)

    def put(self, home: Home) -> None:
        self._db.execute(
            "INSERT INTO homes VALUES (?, ?, ?, ?, ?) ON CONFLICT (kind, id) DO UPDATE SET "
            "tenant = excluded.tenant, name = excluded.name, node = excluded.node",
            (home.kind, home.tenant, home.id, home.name, home.node),
        )

    def find(self, kind: str, tenant: str, key: str) -> Home | None:
        """The tenant's `kind` whose id or name is `key`."""
        row = self._db.execute(
            "SELECT kind, tenant, id, name, node FROM homes WHERE kind = ? AND tenant = ? "
            "AND (id = ? OR name = ?) ORDER BY CASE WHEN id = ? THEN 0 ELSE 1 END LIMIT 1",
            (kind, tenant, key, key, key),
        ).fetchone()
        return Home(*row) if row else None

    def by_id(self, kind: str, id_: str) -> Home | None:
        row = self._db.execute(
            "SELECT kind, tenant, id, name, node FROM homes WHERE kind = ? AND id = ?",
            (kind, id_),
        ).fetchone()
        return Home(*row) if row else None

    def of_tenant(self, kind: str, tenant: str) -> list[Home]:
        rows = self._db.execute(
            "SELECT kind, tenant, id, name, node FROM homes WHERE kind = ? AND tenant = ?",
            (kind, tenant),
        ).fetchall()
        return [Home(*r) for r in rows]

    def count_on(self, kind: str, node: str) -> int:
        row = self._db.execute(
            "SELECT count(*) FROM homes WHERE kind = ? AND node = ?", (kind, node)
        ).fetchone()
        return int(row[0])

    def forget(self, kind: str, id_: str) -> None:
        self._db.execute("DELETE FROM homes WHERE kind = ? AND id = ?", (kind, id_))
