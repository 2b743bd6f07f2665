"""Which node holds which sandbox, and what the gateway last saw of it (SQLite, or the
gateways' shared PostgreSQL).

The nodes are the truth: on start, and whenever a node joins, the gateway lists every
node's sandboxes and writes them here. What this file adds is memory of nodes that are
gone: their sandboxes stay listed as `lost`, with the reason, across gateway restarts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cella.store.sql import Database, database

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
PUT = (
    "INSERT INTO placements VALUES (?, ?, ?, ?, NULL) ON CONFLICT (sandbox_id) DO UPDATE "
    "SET tenant = excluded.tenant, node = excluded.node, body = excluded.body, lost = NULL"
)


@dataclass(frozen=True, slots=True)
class Standing:
    """A sandbox that is neither deleted nor lost, as its quota sees it."""

    sandbox_id: str
    node: str
    state: str
    auto_resume: bool  # a stopped one wakes by itself on traffic


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
    def __init__(self, where: Path | str | Database) -> None:
        self._db = database(where)
        self.db = self._db  # what else the gateway keeps beside it (quota holds)
        self._db.ensure("placements", SCHEMA)
        self._live = f"{self._db.json_text('body', 'state')} != 'deleted'"

    def put(self, node: str, body: dict[str, Any]) -> None:
        self._db.execute(PUT, (body["id"], body.get("tenant") or "", node, json.dumps(body)))

    def put_many(self, node: str, bodies: list[dict[str, Any]]) -> None:
        """A node's answers recorded in one transaction (a list of thousands is one write)."""
        with self._db.transaction() as db:
            db.executemany(
                PUT, [(b["id"], b.get("tenant") or "", node, json.dumps(b)) for b in bodies]
            )

    def get(self, sandbox_id: str) -> Placement | None:
        rows = self._select("WHERE sandbox_id = ?", sandbox_id)
        return rows[0] if rows else None

    def deleted(self, sandbox_id: str) -> None:
        """Deleted on its node, which keeps its trace: still routed there, never listed."""
        self.set_state(sandbox_id, "deleted")

    def set_state(self, sandbox_id: str, state: str) -> None:
        """The sandbox's state as the gateway learned it from a call it relayed (a resume:
        counted in its tenant's quota from now on)."""
        with self._db.transaction() as db:
            row = db.execute(
                "SELECT body FROM placements WHERE sandbox_id = ?", (sandbox_id,)
            ).fetchone()
            if row is not None:
                body = {**json.loads(row[0]), "state": state}
                db.execute(
                    "UPDATE placements SET body = ? WHERE sandbox_id = ?",
                    (json.dumps(body), sandbox_id),
                )

    def standing(self, tenant: str) -> list[Standing]:
        """The tenant's sandboxes that are neither deleted nor lost, as last recorded
        (what its quota counts)."""
        state = self._db.json_text("body", "state")
        wakes = self._db.json_text("body", "auto_resume")
        rows = self._db.execute(
            f"SELECT sandbox_id, node, {state}, {wakes} FROM placements "
            f"WHERE tenant = ? AND lost IS NULL AND {self._live}",
            (tenant,),
        ).fetchall()
        return [Standing(r[0], r[1], r[2] or "", str(r[3]).lower() in ("1", "true")) for r in rows]

    def named(self, tenant: str, name: str) -> list[Placement]:
        """The tenant's sandboxes called `name` that are neither deleted nor lost."""
        named = self._db.json_text("body", "name")
        return self._select(
            f"WHERE tenant = ? AND {named} = ? AND lost IS NULL AND {self._live}", tenant, name
        )

    def forget(self, sandbox_id: str) -> None:
        self._db.execute("DELETE FROM placements WHERE sandbox_id = ?", (sandbox_id,))

    def of_tenant(self, tenant: str) -> list[Placement]:
        return self._select("WHERE tenant = ?", tenant)

    def on_node(self, node: str) -> list[Placement]:
        return self._select("WHERE node = ?", node)

    def lost(self, tenant: str | None = None) -> list[Placement]:
        if tenant is None:
            return self._select(f"WHERE lost IS NOT NULL AND {self._live}")
        return self._select(f"WHERE lost IS NOT NULL AND tenant = ? AND {self._live}", tenant)

    def holding(self) -> set[str]:
        """The nodes that hold sandboxes not known to be lost."""
        # each node's rows looked at until one is live (the poll asks every second: a
        # scan of every row's body grows with the sandboxes, this with the nodes)
        live = self._live.replace("body", "p.body")
        rows = self._db.execute(
            "SELECT n.node FROM (SELECT DISTINCT node FROM placements) AS n WHERE EXISTS "
            f"(SELECT 1 FROM placements AS p WHERE p.node = n.node AND p.lost IS NULL AND {live})"
        ).fetchall()
        return {r[0] for r in rows}

    def lose(self, node: str, reason: str) -> int:
        """Marks every sandbox of the node lost; returns how many."""
        cursor = self._db.execute(
            "UPDATE placements SET lost = ? WHERE node = ? AND lost IS NULL", (reason, node)
        )
        return cursor.rowcount

    def resync(self, node: str, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The node's own list replaces what was recorded for it (a returning node's
        sandboxes are no longer lost; ones it no longer has are forgotten). A sandbox
        recorded on another node, and not lost there, stays there: it was recovered from
        its replica while this node was gone, and this node's copy is the older one.
        Returns those older copies."""
        elsewhere = {
            r[0]
            for r in self._db.execute(
                "SELECT sandbox_id FROM placements WHERE node != ? AND lost IS NULL", (node,)
            ).fetchall()
        }
        stale = [b for b in bodies if b["id"] in elsewhere]
        bodies = [b for b in bodies if b["id"] not in elsewhere]
        with self._db.transaction() as db:
            db.execute(f"DELETE FROM placements WHERE node = ? AND {self._live}", (node,))
            db.executemany(
                PUT, [(b["id"], b.get("tenant") or "", node, json.dumps(b)) for b in bodies]
            )
        return stale

    def _select(self, where: str, *args: object) -> list[Placement]:
        rows = self._db.execute(
            f"SELECT sandbox_id, tenant, node, body, lost FROM placements {where}", args
        ).fetchall()
        return [Placement(r[0], r[1], r[2], json.loads(r[3]), r[4]) for r in rows]
