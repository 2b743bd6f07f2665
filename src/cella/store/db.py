"""The state store: sandboxes, API keys and events in SQLite (WAL)."""

from __future__ import annotations

import json
import sqlite3
import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cella.store.migrations import MIGRATIONS


def now() -> str:
    return datetime.now(UTC).isoformat()


class Store:
    """Small, synchronous and fast: every call is one short transaction."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._migrate()

    def _migrate(self) -> None:
        with self._lock:
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            for i, script in enumerate(MIGRATIONS[version:], start=version + 1):
                self._db.executescript(f"BEGIN;\n{script}\nPRAGMA user_version = {i};\nCOMMIT;")

    @property
    def schema_version(self) -> int:
        return int(self._db.execute("PRAGMA user_version").fetchone()[0])

    def close(self) -> None:
        self._db.close()

    def _exec(self, sql: str, args: tuple[Any, ...] = ()) -> sqlite3.Cursor:
        with self._lock:
            return self._db.execute(sql, args)

    # -- keys ---------------------------------------------------------------------------

    def add_key(self, key_id: str, tenant: str, key_hash: str, admin: bool = False) -> None:
        self._exec(
            "INSERT INTO api_keys (id, tenant, hash, admin, created_at) VALUES (?, ?, ?, ?, ?)",
            (key_id, tenant, key_hash, int(admin), now()),
        )

    def key_by_hash(self, key_hash: str) -> sqlite3.Row | None:
        row: sqlite3.Row | None = self._exec(
            "SELECT * FROM api_keys WHERE hash = ? AND revoked_at IS NULL", (key_hash,)
        ).fetchone()
        return row

    def list_keys(self) -> list[sqlite3.Row]:
        return self._exec(
            "SELECT * FROM api_keys WHERE revoked_at IS NULL ORDER BY created_at"
        ).fetchall()

    def revoke_key(self, key_id: str) -> bool:
        cur = self._exec(
            "UPDATE api_keys SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL",
            (now(), key_id),
        )
        return cur.rowcount > 0

    # -- rows with a lifecycle (sandboxes, snapshots) -------------------------------------

    def _insert(self, table: str, row: dict[str, Any]) -> None:
        row = {**row, "created_at": now(), "updated_at": now()}
        cols = ", ".join(row)
        marks = ", ".join("?" for _ in row)
        self._exec(f"INSERT INTO {table} ({cols}) VALUES ({marks})", tuple(row.values()))

    def _update(self, table: str, row_id: str, fields: dict[str, Any]) -> None:
        fields = {**fields, "updated_at": now()}
        sets = ", ".join(f"{k} = ?" for k in fields)
        self._exec(f"UPDATE {table} SET {sets} WHERE id = ?", (*fields.values(), row_id))

    def _get(self, table: str, row_id: str) -> sqlite3.Row | None:
        row: sqlite3.Row | None = self._exec(
            f"SELECT * FROM {table} WHERE id = ?", (row_id,)
        ).fetchone()
        return row

    def _list(self, table: str, tenant: str | None, states: list[str] | None) -> list[sqlite3.Row]:
        sql = f"SELECT * FROM {table} WHERE 1=1"
        args: list[Any] = []
        if tenant is not None:
            sql += " AND tenant = ?"
            args.append(tenant)
        if states:
            sql += f" AND state IN ({', '.join('?' for _ in states)})"
            args.extend(states)
        return self._exec(sql + " ORDER BY created_at", tuple(args)).fetchall()

    def insert_sandbox(self, row: dict[str, Any]) -> None:
        self._insert("sandboxes", _encode(row))

    def update_sandbox(self, sandbox_id: str, **fields: Any) -> None:
        self._update("sandboxes", sandbox_id, _encode(fields))

    def get_sandbox(self, sandbox_id: str) -> dict[str, Any] | None:
        row = self._get("sandboxes", sandbox_id)
        return _sandbox(row) if row else None

    def list_sandboxes(
        self, tenant: str | None = None, states: list[str] | None = None
    ) -> list[dict[str, Any]]:
        return [_sandbox(r) for r in self._list("sandboxes", tenant, states)]

    def insert_snapshot(self, row: dict[str, Any]) -> None:
        self._insert("snapshots", row)

    def update_snapshot(self, snapshot_id: str, **fields: Any) -> None:
        self._update("snapshots", snapshot_id, fields)

    def get_snapshot(self, snapshot_id: str) -> dict[str, Any] | None:
        row = self._get("snapshots", snapshot_id)
        return dict(row) if row else None

    def list_snapshots(
        self, tenant: str | None = None, states: list[str] | None = None
    ) -> list[dict[str, Any]]:
        return [dict(r) for r in self._list("snapshots", tenant, states)]

    def snapshot_users(self, snapshot_id: str) -> tuple[list[str], list[str]]:
        """Live sandboxes whose disk sits on the snapshot, and snapshots built on it."""
        gone = ("deleted", "error")
        sandboxes = [
            r[0]
            for r in self._exec(
                "SELECT id FROM sandboxes WHERE base_snapshot_id = ? AND state NOT IN (?, ?)",
                (snapshot_id, *gone),
            )
        ]
        snapshots = [
            r[0]
            for r in self._exec(
                "SELECT id FROM snapshots WHERE parent_snapshot_id = ? AND state NOT IN (?, ?)",
                (snapshot_id, *gone),
            )
        ]
        return sandboxes, snapshots

    # -- events ---------------------------------------------------------------------------

    def add_event(self, sandbox_id: str, type_: str, data: dict[str, Any] | None = None) -> int:
        cur = self._exec(
            "INSERT INTO events (sandbox_id, type, at, data) VALUES (?, ?, ?, ?)",
            (sandbox_id, type_, now(), json.dumps(data or {})),
        )
        return int(cur.lastrowid or 0)

    def events(
        self,
        sandbox_id: str,
        after: int = 0,
        limit: int = 1000,
        types: list[str] | None = None,
    ) -> list[dict[str, Any]]:
        sql = "SELECT * FROM events WHERE sandbox_id = ? AND id > ?"
        args: tuple[Any, ...] = (sandbox_id, after)
        if types:
            sql += f" AND type IN ({', '.join('?' for _ in types)})"
            args += tuple(types)
        rows = self._exec(sql + " ORDER BY id LIMIT ?", (*args, limit)).fetchall()
        return [{**dict(r), "data": json.loads(r["data"])} for r in rows]

    # -- secrets (values are read only to hand them to the egress proxy) ------------------

    def put_secret(self, tenant: str, name: str, fields: dict[str, Any]) -> None:
        row = {**fields, "hosts": json.dumps(fields["hosts"])}
        stamp = now()
        self._exec(
            "INSERT INTO secrets (tenant, name, value, hosts, auth, username, created_at, "
            "updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (tenant, name) DO UPDATE "
            "SET value = excluded.value, hosts = excluded.hosts, auth = excluded.auth, "
            "username = excluded.username, updated_at = excluded.updated_at",
            (
                tenant,
                name,
                row["value"],
                row["hosts"],
                row.get("auth"),
                row.get("username"),
                stamp,
                stamp,
            ),
        )

    def get_secret(self, tenant: str, name: str) -> dict[str, Any] | None:
        row = self._exec(
            "SELECT * FROM secrets WHERE tenant = ? AND name = ?", (tenant, name)
        ).fetchone()
        return {**dict(row), "hosts": json.loads(row["hosts"])} if row else None

    def list_secrets(self, tenant: str) -> list[dict[str, Any]]:
        rows = self._exec(
            "SELECT * FROM secrets WHERE tenant = ? ORDER BY name", (tenant,)
        ).fetchall()
        return [{**dict(r), "hosts": json.loads(r["hosts"])} for r in rows]

    def delete_secret(self, tenant: str, name: str) -> bool:
        cur = self._exec("DELETE FROM secrets WHERE tenant = ? AND name = ?", (tenant, name))
        return cur.rowcount > 0


_JSON_COLUMNS = ("labels", "network", "secrets")


def _encode(row: dict[str, Any]) -> dict[str, Any]:
    return {k: json.dumps(v) if k in _JSON_COLUMNS else v for k, v in row.items()}


def _sandbox(row: sqlite3.Row) -> dict[str, Any]:
    out = dict(row)
    for key in _JSON_COLUMNS:
        out[key] = json.loads(out[key])
    return out
