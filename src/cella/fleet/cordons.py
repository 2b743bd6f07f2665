"""Cordoned nodes: the planner places nothing new on them (a node being drained, or held
out by its operator until `uncordon`). Kept in the gateway's database (SQLite, or the
gateways' shared PostgreSQL), so a gateway that restarts mid-drain still keeps new
sandboxes off the node, and a node cordoned through one gateway is cordoned for all."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from cella.store.sql import Database, database

log = logging.getLogger("cella.fleet")
SCHEMA = "CREATE TABLE IF NOT EXISTS cordons (node TEXT PRIMARY KEY);"


class Cordons:
    def __init__(self, where: Path | str | Database, legacy: Path | None = None) -> None:
        self._db = database(where)
        self._db.ensure("cordons", SCHEMA)
        if legacy is not None and legacy.exists():
            self._take_in(legacy)

    def _take_in(self, legacy: Path) -> None:
        """The list an older gateway kept in a file of its own (`cordoned.json`), moved into
        the table once; the file is renamed so that it is not read again."""
        names = json.loads(legacy.read_text() or "[]")
        self._db.executemany(
            "INSERT OR IGNORE INTO cordons (node) VALUES (?)", [(str(n),) for n in names]
        )
        os.replace(legacy, legacy.with_name(legacy.name + ".migrated"))
        log.info("cordoned nodes %s moved from %s into the gateway's database", names, legacy)

    def __contains__(self, node: object) -> bool:
        row = self._db.execute("SELECT 1 FROM cordons WHERE node = ?", (str(node),)).fetchone()
        return row is not None

    def names(self) -> set[str]:
        return {r[0] for r in self._db.execute("SELECT node FROM cordons").fetchall()}

    def cordon(self, node: str) -> None:
        self._db.execute("INSERT OR IGNORE INTO cordons (node) VALUES (?)", (node,))

    def uncordon(self, node: str) -> bool:
        """Whether it was cordoned."""
        return self._db.execute("DELETE FROM cordons WHERE node = ?", (node,)).rowcount > 0
