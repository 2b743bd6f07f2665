"""Which node holds which sandbox, and what the gateway last saw of it (SQLite).

The nodes are the truth: on start, and whenever a node joins, the gateway lists every
node's sandboxes and writes them here. What this file adds is memory of nodes that are
gone: their sandboxes stay listed as `lost`, with the reason, across gateway restarts.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS placements (
    sandbox_id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    node TEXT NOT NULL,
    body TEXT NOT NULL,
    lost TEXT
);
CREATE INDEX IF NOT EXISTS placements_node ON placements (node);
CREATE INDEX IF NOT EXISTS placements_tenant ON placements (tenant);
CREATE INDEX IF NOT EXISTS placements_lost ON placements (tenant) WHERE lost IS NOT NULL;
"""


@dataclass(frozen=True, slots=True)
class Placement:
    sandbox_id: str
    tenant: str
    node: str
    body: dict[str, Any]  # the sandbox as its node last reported it
    lost: str | None = None  # why its node is gone

    def shown(self) -> dict[str, Any]:
        """The sandbox as the gateway reports it: as last seen, or `lost` with the reason."""
        if self.lost is None:
            return self.body
        return {**self.body, "state": "lost", "error": self.lost}


class Placements:
    def __init__(self, path: Path) -> None:
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        # a rebuildable record (the nodes are the truth): no fsync per write, a crash
        # loses at most the last writes, never the file
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)

    def put(self, node: str, body: dict[str, Any]) -> None:
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO placements VALUES (?, ?, ?, ?, NULL)",
                (body["id"], body.get("tenant") or "", node, json.dumps(body)),
            )

    def put_many(self, node: str, bodies: list[dict[str, Any]]) -> None:
        """A node's answers recorded in one transaction (a list of thousands is one write)."""
        with self._lock:
            self._db.execute("BEGIN")
            self._db.executemany(
                "INSERT OR REPLACE INTO placements VALUES (?, ?, ?, ?, NULL)",
                [(b["id"], b.get("tenant") or "", node, json.dumps(b)) for b in bodies],
            )
            self._db.execute("COMMIT")

    def get(self, sandbox_id: str) -> Placement | None:
        rows = self._select("WHERE sandbox_id = ?", sandbox_id)
        return rows[0] if rows else None

    def deleted(self, sandbox_id: str) -> None:
        """Deleted on its node, which keeps its trace: still routed there, never listed."""
        with self._lock:
            self._db.execute(
                "UPDATE placements SET body = json_set(body, '$.state', 'deleted') "
                "WHERE sandbox_id = ?",
                (sandbox_id,),
            )

    def forget(self, sandbox_id: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM placements WHERE sandbox_id = ?", (sandbox_id,))

    def of_tenant(self, tenant: str) -> list[Placement]:
        return self._select("WHERE tenant = ?", tenant)

    def on_node(self, node: str) -> list[Placement]:
        return self._select("WHERE node = ?", node)

    def lost(self, tenant: str | None = None) -> list[Placement]:
        if tenant is None:  # through the partial index: as many as are lost
            return self._select(
                "INDEXED BY placements_lost WHERE lost IS NOT NULL "
                "AND json_extract(body, '$.state') != 'deleted'"
            )
        return self._select(
            "WHERE lost IS NOT NULL AND tenant = ? AND json_extract(body, '$.state') != 'deleted'",
            tenant,
        )

    def holding(self) -> set[str]:
        """The nodes that hold sandboxes not known to be lost."""
        # each node's rows looked at until one is live (the poll asks every second: a
        # scan of every row's body grows with the sandboxes, this with the nodes)
        with self._lock:
            rows = self._db.execute(
                "SELECT n.node FROM (SELECT DISTINCT node FROM placements) AS n WHERE EXISTS "
                "(SELECT 1 FROM placements AS p WHERE p.node = n.node AND p.lost IS NULL "
                "AND json_extract(p.body, '$.state') != 'deleted')"
            ).fetchall()
        return {r[0] for r in rows}

    def lose(self, node: str, reason: str) -> int:
        """Marks every sandbox of the node lost; returns how many."""
        with self._lock:
            cursor = self._db.execute(
                "UPDATE placements SET lost = ? WHERE node = ? AND lost IS NULL", (reason, node)
            )
            return cursor.rowcount

    def resync(self, node: str, bodies: list[dict[str, Any]]) -> None:
        """The node's own list replaces what was recorded for it (a returning node's
        sandboxes are no longer lost; ones it no longer has are forgotten)."""
        with self._lock:
            self._db.execute("BEGIN")
            self._db.execute(
                "DELETE FROM placements WHERE node = ? AND json_extract(body, '$.state') != ?",
                (node, "deleted"),
            )
            self._db.executemany(
                "INSERT OR REPLACE INTO placements VALUES (?, ?, ?, ?, NULL)",
                [(b["id"], b.get("tenant") or "", node, json.dumps(b)) for b in bodies],
            )
            self._db.execute("COMMIT")

    def _select(self, where: str, *args: object) -> list[Placement]:
        with self._lock:
            rows = self._db.execute(
                f"SELECT sandbox_id, tenant, node, body, lost FROM placements {where}", args
            ).fetchall()
        return [Placement(r[0], r[1], r[2], json.loads(r[3]), r[4]) for r in rows]
