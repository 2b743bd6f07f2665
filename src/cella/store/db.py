"""The state store: sandboxes, API keys and events in SQLite (WAL)."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import time
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cella import errors
from cella.models.buckets import BucketMount, BucketState
from cella.models.exec_policy import ExecPolicy
from cella.models.mounts import GitMount
from cella.models.network import NetworkPolicy
from cella.models.sandbox import ExecDefaults, SandboxState, SnapshotState
from cella.models.volumes import VolumeMount
from cella.store.migrations import MIGRATIONS
from cella.store.observe import Observations
from cella.store.records import (
    EvalRunRecord,
    EventRecord,
    IdempotencyRecord,
    KeyRecord,
    KeyUse,
    NamedTemplateRecord,
    RegistryRecord,
    SandboxRecord,
    SecretRecord,
    SecretRef,
    SnapshotRecord,
    TemplateBuildRecord,
    VolumeRecord,
)
from cella.store.sealing import Sealer
from cella.store.sql import Cursor, Database, open_database

AUDIT_TRIM_EVERY = 1000


def now() -> str:
    return datetime.now(UTC).isoformat()


class Store(Observations):
    """Small, synchronous and fast: every call is one short transaction."""

    def __init__(self, where: Path | str | Database) -> None:
        """`where`: an SQLite file, a `postgresql://` URL (the gateways' shared state), or
        a database already open."""
        self._sealer: Sealer | None = None  # set by `seal_with` before secrets are used
        self._db = where if isinstance(where, Database) else open_database(where)
        self.path = getattr(self._db, "path", None)
        self._lock = self._db.lock
        if self._db.dialect == "sqlite":
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA foreign_keys=ON")
        self._db.migrate("store", MIGRATIONS)

    @property
    def database(self) -> Database:
        return self._db

    @property
    def schema_version(self) -> int:
        return self._db.version("store")

    def close(self) -> None:
        self._db.close()

    def _exec(self, sql: str, args: tuple[Any, ...] = ()) -> Cursor:
        with self._lock:
            return self._db.execute(sql, args)

    # -- keys ---------------------------------------------------------------------------

    def add_key(
        self,
        key_id: str,
        tenant: str,
        key_hash: str,
        admin: bool = False,
        read_only: bool = False,
        principal: str | None = None,
        roles: Iterable[str] = ("owner",),
    ) -> None:
        self._exec(
            "INSERT INTO api_keys (id, tenant, hash, admin, read_only, principal, roles, "
            "created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (
                key_id,
                tenant,
                key_hash,
                int(admin),
                int(read_only),
                principal,
                json.dumps(sorted(roles)),
                now(),
            ),
        )

    def add_key_uses(self, uses: Iterable[KeyUse], keep: int) -> None:
        """Appends to the audit log of key use, keeping the newest `keep` entries (trimmed
        once every `AUDIT_TRIM_EVERY` entries: every request writes here)."""
        rows = [(u.key_id, u.tenant, u.at, u.method, u.path, u.status, u.client) for u in uses]
        if not rows:
            return
        with self._lock:
            self._db.executemany(
                "INSERT INTO key_uses (key_id, tenant, at, method, path, status, client) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                rows,
            )
            last = self._db.execute("SELECT MAX(id) FROM key_uses").fetchone()[0]
            if last // AUDIT_TRIM_EVERY != (last - len(rows)) // AUDIT_TRIM_EVERY:
                self._db.execute("DELETE FROM key_uses WHERE id <= ?", (last - keep,))

    def key_uses(self, key_id: str | None, tenant: str | None, limit: int) -> list[KeyUse]:
        """The newest uses, newest first, of one key or one tenant's keys (or all)."""
        sql, args = "SELECT * FROM key_uses WHERE 1=1", list[str]()
        if key_id is not None:
            sql, args = sql + " AND key_id = ?", [*args, key_id]
        if tenant is not None:
            sql, args = sql + " AND tenant = ?", [*args, tenant]
        rows = self._exec(sql + " ORDER BY id DESC LIMIT ?", (*args, limit)).fetchall()
        return [KeyUse(**dict(r)) for r in rows]

    def key_by_hash(self, key_hash: str) -> KeyRecord | None:
        row = self._exec(
            "SELECT * FROM api_keys WHERE hash = ? AND revoked_at IS NULL", (key_hash,)
        ).fetchone()
        return _key(row) if row else None

    def key_by_id(self, key_id: str) -> KeyRecord | None:
        row = self._exec(
            "SELECT * FROM api_keys WHERE id = ? AND revoked_at IS NULL", (key_id,)
        ).fetchone()
        return _key(row) if row else None

    def list_keys(self) -> list[KeyRecord]:
        rows = self._exec("SELECT * FROM api_keys WHERE revoked_at IS NULL ORDER BY created_at")
        return [_key(r) for r in rows.fetchall()]

    def revoke_key(self, key_id: str) -> bool:
        cur = self._exec(
            "UPDATE api_keys SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL",
            (now(), key_id),
        )
        return cur.rowcount > 0

    # -- web console sessions ended before they expired -----------------------------------

    def end_session(self, nonce: str, expires: int) -> None:
        with self._lock:
            self._db.execute(
                "INSERT OR IGNORE INTO ended_sessions (nonce, expires) VALUES (?, ?)",
                (nonce, expires),
            )
            self._db.execute("DELETE FROM ended_sessions WHERE expires < ?", (int(time.time()),))

    def session_ended(self, nonce: str) -> bool:
        row = self._exec("SELECT 1 FROM ended_sessions WHERE nonce = ?", (nonce,)).fetchone()
        return row is not None

    # -- eval runs ------------------------------------------------------------------------

    def add_eval_run(self, run: EvalRunRecord) -> None:
        self._insert("eval_runs", dataclasses.asdict(run))

    def eval_run(self, run_id: str) -> EvalRunRecord | None:
        row = self._exec("SELECT * FROM eval_runs WHERE id = ?", (run_id,)).fetchone()
        return EvalRunRecord(**dict(row)) if row else None

    def eval_runs(self, tenant: str | None, limit: int) -> list[EvalRunRecord]:
        sql, args = "SELECT * FROM eval_runs", list[Any]()
        if tenant is not None:
            sql, args = sql + " WHERE tenant = ?", [tenant]
        rows = self._exec(sql + " ORDER BY created_at DESC LIMIT ?", (*args, limit)).fetchall()
        return [EvalRunRecord(**dict(r)) for r in rows]

    def finish_eval_run(self, run_id: str) -> None:
        self._exec("UPDATE eval_runs SET finished_at = ? WHERE id = ?", (now(), run_id))

    def delete_eval_run(self, run_id: str) -> None:
        self._exec("DELETE FROM eval_results WHERE run_id = ?", (run_id,))
        self._exec("DELETE FROM eval_runs WHERE id = ?", (run_id,))

    def put_eval_result(
        self,
        run_id: str,
        task_id: str,
        sandbox_id: str | None,
        passed: bool,
        error: str | None,
        result: str,
    ) -> None:
        self._exec(
            "INSERT INTO eval_results (run_id, task_id, sandbox_id, passed, error, result, "
            "recorded_at) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (run_id, task_id) DO UPDATE "
            "SET sandbox_id = excluded.sandbox_id, passed = excluded.passed, "
            "error = excluded.error, result = excluded.result, "
            "recorded_at = excluded.recorded_at",
            (run_id, task_id, sandbox_id, int(passed), error, result, now()),
        )

    def eval_counts(self, run_id: str) -> tuple[int, int, int]:
        """(passed, failed, errors) of a run's recorded results."""
        row = self._exec(
            "SELECT COALESCE(SUM(passed), 0), "
            "COALESCE(SUM(CASE WHEN passed = 0 AND error IS NULL THEN 1 ELSE 0 END), 0), "
            "COALESCE(SUM(CASE WHEN error IS NOT NULL THEN 1 ELSE 0 END), 0) "
            "FROM eval_results WHERE run_id = ?",
            (run_id,),
        ).fetchone()
        return int(row[0]), int(row[1]), int(row[2])

    def eval_results(self, run_id: str) -> list[str]:
        rows = self._exec(
            "SELECT result FROM eval_results WHERE run_id = ? ORDER BY recorded_at, task_id",
            (run_id,),
        ).fetchall()
        return [r[0] for r in rows]

    def eval_results_of(
        self, tenant: str, sandbox_ids: Iterable[str]
    ) -> dict[str, tuple[str, str]]:
        """(run id, result JSON) by sandbox id, for the sandboxes that ran a task of one of
        the tenant's eval runs."""
        ids = list(sandbox_ids)
        if not ids:
            return {}
        marks = ", ".join("?" for _ in ids)
        rows = self._exec(
            "SELECT r.sandbox_id, r.run_id, r.result FROM eval_results r "
            "JOIN eval_runs e ON e.id = r.run_id "
            f"WHERE e.tenant = ? AND r.sandbox_id IN ({marks})",
            (tenant, *ids),
        ).fetchall()
        return {r[0]: (r[1], r[2]) for r in rows}

    # -- rows with a lifecycle (sandboxes, snapshots) -------------------------------------

    def _insert(self, table: str, row: dict[str, Any]) -> None:
        cols = ", ".join(row)
        marks = ", ".join("?" for _ in row)
        self._exec(f"INSERT INTO {table} ({cols}) VALUES ({marks})", tuple(row.values()))

    def _update(self, table: str, row_id: str, fields: dict[str, Any]) -> None:
        fields = {**fields, "updated_at": now()}
        sets = ", ".join(f"{k} = ?" for k in fields)
        self._exec(f"UPDATE {table} SET {sets} WHERE id = ?", (*fields.values(), row_id))

    def _get(self, table: str, row_id: str) -> Any | None:
        row: Any | None = self._exec(f"SELECT * FROM {table} WHERE id = ?", (row_id,)).fetchone()
        return row

    def _list(self, table: str, tenant: str | None, states: Iterable[str] | None) -> list[Any]:
        sql = f"SELECT * FROM {table} WHERE 1=1"
        args: list[Any] = []
        if tenant is not None:
            sql += " AND tenant = ?"
            args.append(tenant)
        if states is not None:
            states = list(states)
            sql += f" AND state IN ({', '.join('?' for _ in states)})"
            args.extend(states)
        return self._exec(sql + " ORDER BY created_at", tuple(args)).fetchall()

    def insert_sandbox(self, record: SandboxRecord) -> SandboxRecord:
        """Stores a new sandbox; its timestamps are set here."""
        return self.insert_sandboxes([record])[0]

    def insert_sandboxes(self, records: list[SandboxRecord]) -> list[SandboxRecord]:
        """Stores new sandboxes (a fork's branches) in one transaction: all or none."""
        with self._lock, self._db.transaction():
            for record in records:
                record.created_at = record.updated_at = now()
                self._insert("sandboxes", _encode(dataclasses.asdict(record) | _json_of(record)))
        return records

    def replace_sandbox(self, columns: dict[str, Any]) -> SandboxRecord:
        """A sandbox's row as another node stored it (`sandbox_columns`), kept as it was
        (its timestamps too), over a row of the same id that ended here before."""
        known = {f.name for f in dataclasses.fields(SandboxRecord)}
        try:  # checked: it decodes as a row of this store
            record = _sandbox({k: v for k, v in columns.items() if k in known})
        except (KeyError, TypeError, ValueError) as exc:
            raise errors.InvalidArgument(f"not a sandbox's row: {exc}") from None
        row = _encode(dataclasses.asdict(record) | _json_of(record))
        cols = ", ".join(row)
        marks = ", ".join("?" for _ in row)
        self._exec(
            f"INSERT OR REPLACE INTO sandboxes ({cols}) VALUES ({marks})", tuple(row.values())
        )
        return record

    def update_sandbox(self, sandbox_id: str, **fields: Any) -> None:
        self._update("sandboxes", sandbox_id, _encode(fields))

    def get_sandbox(self, sandbox_id: str) -> SandboxRecord | None:
        row = self._get("sandboxes", sandbox_id)
        return _sandbox(row) if row else None

    def sandboxes_named(self, tenant: str, name: str) -> list[SandboxRecord]:
        """The tenant's sandboxes called `name` that are not deleted, oldest first (names
        are unique per creator and among those the tenant sees: `cella.policy.access`)."""
        rows = self._exec(
            "SELECT * FROM sandboxes WHERE tenant = ? AND name = ? AND state != 'deleted' "
            "ORDER BY created_at, rowid",
            (tenant, name),
        ).fetchall()
        return [_sandbox(r) for r in rows]

    def list_sandboxes(
        self, tenant: str | None = None, states: Iterable[str] | None = None
    ) -> list[SandboxRecord]:
        """Sandboxes, oldest first; `states=None` means all (the deleted ones too)."""
        return [_sandbox(r) for r in self._list("sandboxes", tenant, states)]

    def usage_by_tenant(self, states: Iterable[str]) -> dict[str, tuple[int, int, int]]:
        """(sandboxes, vCPUs, MiB) per tenant of the sandboxes in `states`: what admission
        weighs on every create, summed here rather than by decoding each live row (which
        made a burst's admission grow with the square of its size)."""
        states = list(states)
        marks = ", ".join("?" for _ in states)
        rows = self._exec(
            "SELECT tenant, COUNT(*), COALESCE(SUM(vcpus), 0), COALESCE(SUM(memory_mib), 0) "
            f"FROM sandboxes WHERE state IN ({marks}) GROUP BY tenant",
            tuple(states),
        ).fetchall()
        return {str(t): (int(n), int(c), int(m)) for t, n, c, m in rows}

    def count_sandboxes_by_state(self) -> dict[str, int]:
        rows = self._exec("SELECT state, COUNT(*) FROM sandboxes GROUP BY state", ()).fetchall()
        return {str(state): int(n) for state, n in rows}

    def insert_snapshot(self, record: SnapshotRecord) -> SnapshotRecord:
        record.created_at = record.updated_at = now()
        self._insert("snapshots", dataclasses.asdict(record))
        return record

    def update_snapshot(self, snapshot_id: str, **fields: Any) -> None:
        self._update("snapshots", snapshot_id, fields)

    def get_snapshot(self, snapshot_id: str) -> SnapshotRecord | None:
        row = self._get("snapshots", snapshot_id)
        return _snapshot(row) if row else None

    def list_snapshots(
        self, tenant: str | None = None, states: Iterable[str] | None = None
    ) -> list[SnapshotRecord]:
        return [_snapshot(r) for r in self._list("snapshots", tenant, states)]

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

    # -- snapshot tags (a name's tags move between snapshots, as Docker's do) --------------

    def set_tag(self, tenant: str, name: str, tag: str, snapshot_id: str) -> None:
        self._exec(
            "INSERT INTO snapshot_tags (tenant, name, tag, snapshot_id, updated_at) "
            "VALUES (?, ?, ?, ?, ?) ON CONFLICT (tenant, name, tag) DO UPDATE SET "
            "snapshot_id = excluded.snapshot_id, updated_at = excluded.updated_at",
            (tenant, name, tag, snapshot_id, now()),
        )

    def tags(self, tenant: str, name: str | None = None) -> list[tuple[str, str, str]]:
        """(name, tag, snapshot id) of the tenant's tags, of one name or all."""
        sql = "SELECT name, tag, snapshot_id FROM snapshot_tags WHERE tenant = ?"
        args: tuple[Any, ...] = (tenant,)
        if name is not None:
            sql += " AND name = ?"
            args += (name,)
        return [tuple(r) for r in self._exec(sql + " ORDER BY name, tag", args).fetchall()]

    def untag_snapshot(self, snapshot_id: str) -> None:
        self._exec("DELETE FROM snapshot_tags WHERE snapshot_id = ?", (snapshot_id,))

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
        exec_id: int | None = None,
    ) -> list[EventRecord]:
        """With `exec_id`: that exec's event and those under it (its processes)."""
        sql = "SELECT * FROM events WHERE sandbox_id = ? AND id > ?"
        args: tuple[Any, ...] = (sandbox_id, after)
        if types:
            sql += f" AND type IN ({', '.join('?' for _ in types)})"
            args += tuple(types)
        if exec_id is not None:
            sql += " AND (id = ? OR json_extract(data, '$.exec') = ?)"
            args += (exec_id, exec_id)
        rows = self._exec(sql + " ORDER BY id LIMIT ?", (*args, limit)).fetchall()
        return [EventRecord(**{**dict(r), "data": json.loads(r["data"])}) for r in rows]

    def link_to_exec(self, sandbox_id: str, event_ids: list[int], exec_id: int) -> None:
        """Names the exec event written after them in `exec` and `process.exec` of events
        made while it ran (the connections its processes opened)."""
        for start in range(0, len(event_ids), 500):
            ids = event_ids[start : start + 500]
            self._exec(
                "UPDATE events SET data = json_set(data, '$.exec', ?, '$.process.exec', ?)"
                f" WHERE sandbox_id = ? AND id IN ({', '.join('?' for _ in ids)})",
                (exec_id, exec_id, sandbox_id, *ids),
            )

    def events_between(
        self,
        sandbox_id: str,
        since: str | None,
        until: str | None,
        backward: bool = False,
        limit: int = 1000,
    ) -> list[EventRecord]:
        sql = "SELECT * FROM events WHERE sandbox_id = ?"
        args: list[Any] = [sandbox_id]
        if since is not None:
            sql += " AND at >= ?"
            args.append(since)
        if until is not None:
            sql += " AND at <= ?"
            args.append(until)
        sql += f" ORDER BY id {'DESC' if backward else 'ASC'} LIMIT ?"
        rows = self._exec(sql, (*args, limit)).fetchall()
        return [EventRecord(**{**dict(r), "data": json.loads(r["data"])}) for r in rows]

    # -- secrets (values are read only to hand them to the egress proxy) ------------------

    def seal_with(self, sealer: Sealer) -> None:
        """Values are sealed with `sealer` from now on; any an older version kept in clear
        are sealed now."""
        if not self.opens_with(sealer):
            raise errors.HostError(
                "the secrets key does not open the secrets in the database (a wrong "
                "secrets_key_file or secrets_key_command?)"
            )
        self._sealer = sealer
        rows = self._exec("SELECT tenant, name, value FROM secrets").fetchall()
        for row in rows:
            if not Sealer.is_sealed(row["value"]):
                sealed = sealer.seal(row["value"], _owner(row))
                self._exec(
                    "UPDATE secrets SET value = ? WHERE tenant = ? AND name = ?",
                    (sealed, row["tenant"], row["name"]),
                )

    def opens_with(self, sealer: Sealer) -> bool:
        """Whether `sealer` opens the sealed values (true when there are none)."""
        row = self._exec(
            "SELECT tenant, name, value FROM secrets WHERE value LIKE 'sealed:%' LIMIT 1"
        ).fetchone()
        held = self._exec(
            "SELECT tenant, id, value FROM registries WHERE value LIKE 'sealed:%' LIMIT 1"
        ).fetchone()
        try:
            if row is not None:
                sealer.open(row["value"], _owner(row))
            if held is not None:
                sealer.open(held["value"], _registry_owner(held))
            for _, owner, sealed in self.sealed_webhooks()[:1]:
                sealer.open(sealed, owner)
        except errors.HostError:
            return False
        return True

    def reseal(self, new: Sealer) -> int:
        """Every value under `new`, in one transaction; returns how many."""
        old = self._sealing()
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                rows = self._db.execute("SELECT tenant, name, value FROM secrets").fetchall()
                for row in rows:
                    value = new.seal(old.open(row["value"], _owner(row)), _owner(row))
                    self._db.execute(
                        "UPDATE secrets SET value = ? WHERE tenant = ? AND name = ?",
                        (value, row["tenant"], row["name"]),
                    )
                held = self._db.execute("SELECT tenant, id, value FROM registries").fetchall()
                for row in held:
                    if row["value"] is None:
                        continue
                    owner = _registry_owner(row)
                    value = new.seal(old.open(row["value"], owner), owner)
                    self._db.execute(
                        "UPDATE registries SET value = ? WHERE id = ?", (value, row["id"])
                    )
                hooks = self._db.execute("SELECT id, tenant, value FROM webhooks").fetchall()
                for row in hooks:
                    owner = f"webhook/{row['tenant']}/{row['id']}"
                    value = new.seal(old.open(row["value"], owner), owner)
                    self._db.execute(
                        "UPDATE webhooks SET value = ? WHERE id = ?", (value, row["id"])
                    )
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        self._sealer = new
        return len(rows) + len(held) + len(hooks)

    def _sealing(self) -> Sealer:
        if self._sealer is None:
            raise errors.HostError("no secrets key: secrets cannot be stored or read")
        return self._sealer

    def put_secret(self, record: SecretRecord) -> None:
        record.created_at = record.updated_at = now()
        sealed = self._sealing().seal(record.value, f"{record.tenant}/{record.name}")
        self._exec(
            "INSERT INTO secrets (tenant, name, value, hosts, auth, username, inject, "
            "metadata, created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
            "ON CONFLICT (tenant, name) DO UPDATE SET value = excluded.value, "
            "hosts = excluded.hosts, auth = excluded.auth, username = excluded.username, "
            "inject = excluded.inject, metadata = excluded.metadata, "
            "version = secrets.version + 1, updated_at = excluded.updated_at",
            (
                record.tenant,
                record.name,
                sealed,
                json.dumps(record.hosts),
                record.auth,
                record.username,
                record.inject,
                json.dumps(record.metadata),
                record.created_at,
                record.updated_at,
            ),
        )

    def get_secret(self, tenant: str, name: str) -> SecretRecord | None:
        row = self._exec(
            "SELECT * FROM secrets WHERE tenant = ? AND name = ?", (tenant, name)
        ).fetchone()
        return self._secret(row) if row else None

    def list_secrets(self, tenant: str | None) -> list[SecretRecord]:
        """The tenant's secrets (None: every tenant's)."""
        if tenant is None:
            rows = self._exec("SELECT * FROM secrets ORDER BY tenant, name").fetchall()
        else:
            rows = self._exec(
                "SELECT * FROM secrets WHERE tenant = ? ORDER BY name", (tenant,)
            ).fetchall()
        return [self._secret(r) for r in rows]

    def _secret(self, row: Any) -> SecretRecord:
        value = self._sealing().open(row["value"], _owner(row))
        fields = {**dict(row), "value": value, "hosts": json.loads(row["hosts"])}
        return SecretRecord(**fields | {"metadata": json.loads(row["metadata"])})

    def delete_secret(self, tenant: str, name: str) -> bool:
        cur = self._exec("DELETE FROM secrets WHERE tenant = ? AND name = ?", (tenant, name))
        return cur.rowcount > 0

    # -- image registries (a password is read only to pull an image with it) -------------

    def put_registry(self, record: RegistryRecord) -> RegistryRecord:
        """Inserts the registry, or replaces the one with its id (created_at kept)."""
        record.updated_at = now()
        record.created_at = record.created_at or record.updated_at
        sealed = (
            None
            if record.password is None
            else self._sealing().seal(record.password, _registry_owner(record))
        )
        try:
            self._exec(
                "INSERT INTO registries (id, tenant, name, url, username, value, created_at, "
                "updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET "
                "name = excluded.name, url = excluded.url, username = excluded.username, "
                "value = excluded.value, updated_at = excluded.updated_at",
                (record.id, record.tenant, record.name, record.url, record.username, sealed,
                 record.created_at, record.updated_at),
            )  # fmt: skip
        except sqlite3.IntegrityError:
            raise errors.Conflict(f"a registry named {record.name!r} exists") from None
        return record

    def get_registry(self, tenant: str, key: str) -> RegistryRecord | None:
        """The tenant's registry by id or name."""
        row = self._exec(
            "SELECT * FROM registries WHERE tenant = ? AND (id = ? OR name = ?)",
            (tenant, key, key),
        ).fetchone()
        return self._registry(row) if row else None

    def list_registries(self, tenant: str) -> list[RegistryRecord]:
        rows = self._exec(
            "SELECT * FROM registries WHERE tenant = ? ORDER BY created_at DESC, id", (tenant,)
        ).fetchall()
        return [self._registry(r) for r in rows]

    def _registry(self, row: Any) -> RegistryRecord:
        data = dict(row)
        sealed = data.pop("value")
        password = None if sealed is None else self._sealing().open(sealed, _registry_owner(row))
        return RegistryRecord(**data, password=password)

    def delete_registry(self, tenant: str, registry_id: str) -> bool:
        cur = self._exec(
            "DELETE FROM registries WHERE tenant = ? AND id = ?", (tenant, registry_id)
        )
        return cur.rowcount > 0

    # -- volumes (their files are the volumes room's, on the host) -----------------------

    def put_volume(self, record: VolumeRecord) -> VolumeRecord:
        record.created_at = record.created_at or now()
        try:
            self._exec(
                "INSERT INTO volumes (id, tenant, name, created_at) VALUES (?, ?, ?, ?)",
                (record.id, record.tenant, record.name, record.created_at),
            )
        except sqlite3.IntegrityError:
            raise errors.AlreadyExists(f"a volume named {record.name!r} exists") from None
        return record

    def get_volume(self, tenant: str, key: str) -> VolumeRecord | None:
        """The tenant's volume by id or name."""
        row = self._exec(
            "SELECT * FROM volumes WHERE tenant = ? AND (id = ? OR name = ?)", (tenant, key, key)
        ).fetchone()
        return VolumeRecord(**dict(row)) if row else None

    def volume_by_id(self, volume_id: str) -> VolumeRecord | None:
        row = self._exec("SELECT * FROM volumes WHERE id = ?", (volume_id,)).fetchone()
        return VolumeRecord(**dict(row)) if row else None

    def list_volumes(self, tenant: str | None) -> list[VolumeRecord]:
        if tenant is None:
            rows = self._exec("SELECT * FROM volumes ORDER BY created_at, id").fetchall()
        else:
            rows = self._exec(
                "SELECT * FROM volumes WHERE tenant = ? ORDER BY created_at, id", (tenant,)
            ).fetchall()
        return [VolumeRecord(**dict(r)) for r in rows]

    def delete_volume(self, tenant: str, volume_id: str) -> bool:
        cur = self._exec("DELETE FROM volumes WHERE tenant = ? AND id = ?", (tenant, volume_id))
        return cur.rowcount > 0

    # -- templates built from steps (their names, builds and tags) -------------------------

    def add_named_template(self, record: NamedTemplateRecord) -> NamedTemplateRecord:
        record.created_at = record.updated_at = now()
        try:
            self._insert("named_templates", dataclasses.asdict(record))
        except sqlite3.IntegrityError:
            raise errors.Conflict(f"a template named {record.name!r} exists") from None
        return record

    def named_template(self, tenant: str, key: str) -> NamedTemplateRecord | None:
        """The tenant's template by id or name."""
        row = self._exec(
            "SELECT * FROM named_templates WHERE tenant = ? AND (id = ? OR name = ?)",
            (tenant, key, key),
        ).fetchone()
        return NamedTemplateRecord(**dict(row)) if row else None

    def named_templates(self, tenant: str | None) -> list[NamedTemplateRecord]:
        rows = self._list("named_templates", tenant, None)
        return [NamedTemplateRecord(**dict(r)) for r in rows]

    def delete_named_template(self, template_id: str) -> None:
        for table, column in (
            ("template_tags", "template_id"),
            ("template_builds", "template_id"),
            ("named_templates", "id"),
        ):
            self._exec(f"DELETE FROM {table} WHERE {column} = ?", (template_id,))  # fmt: skip

    def insert_build(self, record: TemplateBuildRecord) -> TemplateBuildRecord:
        record.created_at = record.updated_at = now()
        self._insert("template_builds", dataclasses.asdict(record))
        return record

    def update_build(self, build_id: str, **fields: Any) -> None:
        self._update("template_builds", build_id, fields)

    def get_build(self, build_id: str) -> TemplateBuildRecord | None:
        row = self._get("template_builds", build_id)
        return TemplateBuildRecord(**dict(row)) if row else None

    def builds_of(self, template_id: str) -> list[TemplateBuildRecord]:
        rows = self._exec(
            "SELECT * FROM template_builds WHERE template_id = ? ORDER BY created_at, rowid",
            (template_id,),
        ).fetchall()
        return [TemplateBuildRecord(**dict(r)) for r in rows]

    def builds_in(self, states: Iterable[str]) -> list[TemplateBuildRecord]:
        return [TemplateBuildRecord(**dict(r)) for r in self._list("template_builds", None, states)]

    def set_template_tag(self, template_id: str, tag: str, build_id: str) -> None:
        self._exec(
            "INSERT INTO template_tags (template_id, tag, build_id, created_at) "
            "VALUES (?, ?, ?, ?) ON CONFLICT (template_id, tag) DO UPDATE SET "
            "build_id = excluded.build_id, created_at = excluded.created_at",
            (template_id, tag, build_id, now()),
        )

    def template_tags(self, template_id: str) -> list[tuple[str, str, str]]:
        """(tag, build id, when it was set) of each of the template's tags."""
        rows = self._exec(
            "SELECT tag, build_id, created_at FROM template_tags WHERE template_id = ? "
            "ORDER BY created_at, tag",
            (template_id,),
        ).fetchall()
        return [(r[0], r[1], r[2]) for r in rows]

    def delete_template_tag(self, template_id: str, tag: str) -> bool:
        cur = self._exec(
            "DELETE FROM template_tags WHERE template_id = ? AND tag = ?", (template_id, tag)
        )
        return cur.rowcount > 0

    # -- idempotency keys -----------------------------------------------------------------

    def claim_idempotency(self, record: IdempotencyRecord) -> None:
        """Records a request about to run with its key (replacing one that never ended)."""
        self._exec(
            "INSERT INTO idempotency_keys (tenant, route, key, body_hash, result, created_at, "
            "owner) VALUES (?, ?, ?, ?, NULL, ?, ?) ON CONFLICT (tenant, route, key) DO UPDATE "
            "SET body_hash = excluded.body_hash, result = NULL, "
            "created_at = excluded.created_at, owner = excluded.owner",
            (
                record.tenant,
                record.route,
                record.key,
                record.body_hash,
                record.created_at,
                record.owner,
            ),
        )

    def idempotency(self, tenant: str, route: str, key: str) -> IdempotencyRecord | None:
        row = self._exec(
            "SELECT * FROM idempotency_keys WHERE tenant = ? AND route = ? AND key = ?",
            (tenant, route, key),
        ).fetchone()
        if row is None:
            return None
        result = json.loads(row["result"]) if row["result"] is not None else None
        return IdempotencyRecord(**{**dict(row), "result": result})

    def finish_idempotency(self, tenant: str, route: str, key: str, result: list[str]) -> None:
        self._exec(
            "UPDATE idempotency_keys SET result = ? WHERE tenant = ? AND route = ? AND key = ?",
            (json.dumps(result), tenant, route, key),
        )

    def drop_idempotency(self, tenant: str, route: str, key: str) -> None:
        self._exec(
            "DELETE FROM idempotency_keys WHERE tenant = ? AND route = ? AND key = ?",
            (tenant, route, key),
        )

    def expire_idempotency(self, before: float) -> None:
        self._exec("DELETE FROM idempotency_keys WHERE created_at < ?", (before,))


def sandbox_columns(record: SandboxRecord) -> dict[str, Any]:
    """A sandbox's row as its columns (JSON-safe): what a move carries to another node."""
    return _encode(dataclasses.asdict(record) | _json_of(record))


def _json_of(record: SandboxRecord) -> dict[str, Any]:
    return {
        "network": record.network.model_dump(),
        "exec_defaults": record.exec_defaults.model_dump(),
        "exec_policy": record.exec_policy.model_dump() if record.exec_policy else None,
        "mounts": [m.model_dump() for m in record.mounts],
        "bucket_mounts": [m.model_dump() for m in record.bucket_mounts],
        "volume_mounts": [m.model_dump() for m in record.volume_mounts],
        "mount_states": {k: v.model_dump(mode="json") for k, v in record.mount_states.items()},
        "secrets": {k: dataclasses.asdict(v) for k, v in record.secrets.items()},
    }


def _encode(fields: dict[str, Any]) -> dict[str, Any]:
    """Column values for SQLite: JSON columns as text."""
    out = dict(fields)
    for key in ("network", "exec_defaults"):
        if isinstance(out.get(key), NetworkPolicy | ExecDefaults):
            out[key] = out[key].model_dump()
    if "mounts" in out:
        out["mounts"] = [m.model_dump() if isinstance(m, GitMount) else m for m in out["mounts"]]
    if "bucket_mounts" in out:
        out["bucket_mounts"] = [
            m.model_dump() if isinstance(m, BucketMount) else m for m in out["bucket_mounts"]
        ]
    if "volume_mounts" in out:
        out["volume_mounts"] = [
            m.model_dump() if isinstance(m, VolumeMount) else m for m in out["volume_mounts"]
        ]
    if "mount_states" in out:
        out["mount_states"] = {
            k: v.model_dump(mode="json") if isinstance(v, BucketState) else v
            for k, v in out["mount_states"].items()
        }
    if "secrets" in out:
        out["secrets"] = {
            k: dataclasses.asdict(v) if isinstance(v, SecretRef) else v
            for k, v in out["secrets"].items()
        }
    for key in ("labels", "network", "secrets", "exec_defaults", "mounts", "bucket_mounts",
                "mount_states", "shares", "volume_mounts"):  # fmt: skip
        if key in out:
            out[key] = json.dumps(out[key])
    if isinstance(out.get("exec_policy"), ExecPolicy):
        out["exec_policy"] = out["exec_policy"].model_dump()
    for key in ("delegation", "rewrite_setter", "exec_policy"):
        if out.get(key) is not None:
            out[key] = json.dumps(out[key])
    return out


def _sandbox(row: Any) -> SandboxRecord:
    out = dict(row)
    out["labels"] = json.loads(out["labels"])
    out["shares"] = json.loads(out["shares"])
    out["network"] = NetworkPolicy.model_validate(json.loads(out["network"]))
    out["exec_defaults"] = ExecDefaults.model_validate(json.loads(out["exec_defaults"]))
    out["secrets"] = {k: SecretRef(**v) for k, v in json.loads(out["secrets"]).items()}
    policy = out["exec_policy"]
    out["exec_policy"] = ExecPolicy.model_validate(json.loads(policy)) if policy else None
    out["mounts"] = [GitMount.model_validate(m) for m in json.loads(out["mounts"])]
    out["bucket_mounts"] = [BucketMount.model_validate(m) for m in json.loads(out["bucket_mounts"])]
    out["volume_mounts"] = [VolumeMount.model_validate(m) for m in json.loads(out["volume_mounts"])]
    states = json.loads(out["mount_states"]).items()
    out["mount_states"] = {k: BucketState.model_validate(v) for k, v in states}
    out["state"] = SandboxState(out["state"])
    out["stop_keeps_memory"] = bool(out["stop_keeps_memory"])
    out["auto_resume"] = bool(out["auto_resume"])
    out["checkpoint_each_exec"] = bool(out["checkpoint_each_exec"])
    out["delegation"] = json.loads(out["delegation"]) if out["delegation"] else None
    setter = out["rewrite_setter"]
    out["rewrite_setter"] = json.loads(setter) if setter else None
    return SandboxRecord(**out)


def _snapshot(row: Any) -> SnapshotRecord:
    out = dict(row)
    out["state"] = SnapshotState(out["state"])
    out["memory"] = bool(out["memory"])
    return SnapshotRecord(**out)


def _owner(row: Any) -> str:
    """What a sealed value is bound to: its row."""
    return f"{row['tenant']}/{row['name']}"


def _registry_owner(row: Any | RegistryRecord) -> str:
    """A registry's password is bound to its tenant and id (never a secret's row)."""
    if isinstance(row, RegistryRecord):
        return f"registry:{row.tenant}/{row.id}"
    return f"registry:{row['tenant']}/{row['id']}"


def _key(row: Any) -> KeyRecord:
    return KeyRecord(
        **{
            **dict(row),
            "admin": bool(row["admin"]),
            "read_only": bool(row["read_only"]),
            "roles": json.loads(row["roles"]),
        }
    )
