"""One SQL connection, SQLite's or PostgreSQL's, spoken to the same way.

The store and the gateway's tables write SQL both engines take (`?` placeholders, `ON
CONFLICT` upserts) and run it here: an SQLite file (the default: one daemon, one gateway) or
a PostgreSQL database (`database_url`, `postgresql://...`), which several gateways share.
What differs is said here once: placeholders, column types in schemas, `INSERT OR IGNORE`,
schema versions (`PRAGMA user_version` or a table) and their migration under a lock, so
gateways starting together migrate once.
"""

from __future__ import annotations

import contextlib
import re
import sqlite3
import threading
import uuid
import zlib
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

Dialect = Literal["sqlite", "postgres"]
POSTGRES_SCHEMES = ("postgresql://", "postgres://")
CONNECT_TIMEOUT = 10  # seconds: a database that does not answer is an error, not a hang


class Cursor(Protocol):
    """What a statement gives back (sqlite3's cursor, or PostgreSQL's in its clothes)."""

    @property
    def rowcount(self) -> int: ...
    @property
    def lastrowid(self) -> int | None: ...

    def fetchone(self) -> Any: ...
    def fetchall(self) -> list[Any]: ...
    def __iter__(self) -> Iterator[Any]: ...


def is_postgres(url: str | Path | None) -> bool:
    return isinstance(url, str) and url.startswith(POSTGRES_SCHEMES)


def open_database(where: str | Path) -> Database:
    """An SQLite file (a path) or a PostgreSQL database (a `postgresql://` URL)."""
    if is_postgres(where):
        return PostgresDatabase(str(where))
    return SqliteDatabase(Path(where))


def database(where: str | Path | Database) -> Database:
    """`where` open (a database given is used as it is)."""
    return where if isinstance(where, Database) else open_database(where)


def lock_key(name: str) -> int:
    """A PostgreSQL advisory lock's number for a name (the same on every gateway)."""
    return zlib.crc32(f"cella:{name}".encode())


class Database:
    """A connection, used by one thread at a time (`lock`); every statement commits on its
    own unless inside `transaction()`."""

    dialect: Dialect

    def __init__(self) -> None:
        self.lock = threading.RLock()

    def execute(self, sql: str, args: Sequence[Any] = ()) -> Cursor:
        raise NotImplementedError

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        raise NotImplementedError

    def executescript(self, sql: str) -> None:
        """Statements with no parameters, as given (a schema)."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Database]:
        """Statements that hold together: all committed, or none."""
        with self.lock:
            self.execute("BEGIN IMMEDIATE")
            try:
                yield self
            except BaseException:
                self.execute("ROLLBACK")
                raise
            self.execute("COMMIT")

    def json_text(self, column: str, key: str) -> str:
        """An SQL expression: the text at `key` of the JSON object in `column`."""
        raise NotImplementedError

    # -- schema ---------------------------------------------------------------------------

    def ensure(self, name: str, schema: str) -> None:
        """Creates what `schema` creates (`IF NOT EXISTS`), once even when several
        processes start together."""
        self.migrate(name, [schema], versioned=False)

    def migrate(self, name: str, scripts: Sequence[str], versioned: bool = True) -> None:
        """Runs the scripts not run yet on this database (`name`'s version counts them)."""
        raise NotImplementedError

    def version(self, name: str) -> int:
        raise NotImplementedError


class SqliteDatabase(Database):
    dialect: Dialect = "sqlite"

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        self.db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")

    def execute(self, sql: str, args: Sequence[Any] = ()) -> Cursor:
        with self.lock:
            return self.db.execute(sql, args)

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        with self.lock:
            self.db.executemany(sql, rows)

    def executescript(self, sql: str) -> None:
        with self.lock:
            self.db.executescript(sql)

    def close(self) -> None:
        self.db.close()

    def json_text(self, column: str, key: str) -> str:
        return f"json_extract({column}, '$.{key}')"

    def migrate(self, name: str, scripts: Sequence[str], versioned: bool = True) -> None:
        with self.lock:
            if not versioned:
                self.db.executescript(scripts[0])
                return
            # one file, one versioned schema: SQLite's own counter
            version = self.version(name)
            for i, script in enumerate(scripts[version:], start=version + 1):
                self.db.executescript(f"BEGIN;\n{script}\nPRAGMA user_version = {i};\nCOMMIT;")

    def version(self, name: str) -> int:
        return int(self.db.execute("PRAGMA user_version").fetchone()[0])


class Row(tuple[Any, ...]):
    """A PostgreSQL row read as sqlite3.Row is: by position or by column name."""

    names: tuple[str, ...] = ()

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            return super().__getitem__(self.names.index(key))
        return super().__getitem__(key)

    def keys(self) -> list[str]:
        return list(self.names)


class _PgCursor:
    def __init__(self, rows: list[Row], rowcount: int) -> None:
        self._rows = rows
        self.rowcount = rowcount
        self.lastrowid: int | None = None  # PostgreSQL has none: use RETURNING

    def fetchone(self) -> Row | None:
        return self._rows.pop(0) if self._rows else None

    def fetchall(self) -> list[Row]:
        rows, self._rows = self._rows, []
        return rows

    def __iter__(self) -> Iterator[Row]:
        return iter(self.fetchall())


# SQLite's schema words that PostgreSQL spells otherwise (its INTEGER is 32 bits, REAL 32)
_DDL = [
    (re.compile(r"\bINTEGER PRIMARY KEY AUTOINCREMENT\b", re.I),
     "BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY"),
    (re.compile(r"\bINTEGER\b", re.I), "BIGINT"),
    (re.compile(r"\bREAL\b", re.I), "DOUBLE PRECISION"),
]  # fmt: skip
_OR_IGNORE = re.compile(r"^\s*INSERT OR IGNORE INTO\b", re.I)


def postgres_ddl(script: str) -> str:
    for pattern, replacement in _DDL:
        script = pattern.sub(replacement, script)
    return script


def postgres_sql(sql: str, args: Sequence[Any]) -> str:
    """SQLite's statement as PostgreSQL takes it."""
    if _OR_IGNORE.match(sql):
        sql = _OR_IGNORE.sub("INSERT INTO", sql) + " ON CONFLICT DO NOTHING"
    elif sql.strip().upper() == "BEGIN IMMEDIATE":
        sql = "BEGIN"
    if args:
        sql = sql.replace("%", "%%").replace("?", "%s")
    return sql


def _params(args: Sequence[Any]) -> tuple[Any, ...] | None:
    # booleans are kept as integers, as SQLite keeps them
    return tuple(int(a) if isinstance(a, bool) else a for a in args) if args else None


class PostgresDatabase(Database):
    dialect: Dialect = "postgres"

    def __init__(self, url: str) -> None:
        super().__init__()
        self.url = url
        self._in_transaction = False
        self.db = self._connect()

    def _connect(self) -> Any:
        import psycopg  # only where PostgreSQL is used

        return psycopg.connect(self.url, autocommit=True, connect_timeout=CONNECT_TIMEOUT)

    def _run(self, sql: str, params: Any, many: bool = False) -> _PgCursor:
        import psycopg

        with self.lock:
            if self.db.closed and not self._in_transaction:
                self.db = self._connect()  # the server restarted, or the connection broke
            try:
                with self.db.cursor() as cur:
                    if many:
                        cur.executemany(sql, params)
                        return _PgCursor([], cur.rowcount)
                    cur.execute(sql, params)
                    rows = []
                    if cur.description is not None:
                        names = tuple(c.name for c in cur.description)
                        for raw in cur.fetchall():
                            row = Row(raw)
                            row.names = names
                            rows.append(row)
                    return _PgCursor(rows, cur.rowcount)
            except psycopg.IntegrityError as exc:  # callers catch it as SQLite's
                raise sqlite3.IntegrityError(str(exc)) from exc
            except psycopg.OperationalError:
                if self.db.closed and not self._in_transaction:
                    self.db = self._connect()  # next call runs on a fresh connection
                raise

    def execute(self, sql: str, args: Sequence[Any] = ()) -> Cursor:
        word = sql.strip().upper()
        with self.lock:
            cursor = self._run(postgres_sql(sql, args), _params(args))
            if word.startswith("BEGIN"):
                self._in_transaction = True
            elif word in ("COMMIT", "ROLLBACK"):
                self._in_transaction = False
            return cursor

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        params = [_params(r) for r in rows]
        if params:
            self._run(postgres_sql(sql, params[0] or ()), params, many=True)

    def executescript(self, sql: str) -> None:
        self._run(postgres_ddl(sql), None)

    def close(self) -> None:
        self.db.close()

    def json_text(self, column: str, key: str) -> str:
        return f"({column}::jsonb ->> '{key}')"

    def migrate(self, name: str, scripts: Sequence[str], versioned: bool = True) -> None:
        with self.transaction():
            # every gateway starting now waits here for the first to finish
            self._run(f"SELECT pg_advisory_xact_lock({lock_key('schema')})", None)
            if not versioned:
                self._run(postgres_ddl(scripts[0]), None)
                return
            self._run(
                "CREATE TABLE IF NOT EXISTS schema_versions "
                "(name TEXT PRIMARY KEY, version BIGINT NOT NULL)",
                None,
            )
            version = self.version(name)
            for script in scripts[version:]:
                self._run(postgres_ddl(script), None)
            self._run(
                "INSERT INTO schema_versions VALUES (%s, %s) "
                "ON CONFLICT (name) DO UPDATE SET version = excluded.version",
                (name, len(scripts)),
            )

    def version(self, name: str) -> int:
        try:
            rows = self._run("SELECT version FROM schema_versions WHERE name = %s", (name,))
        except Exception:  # no table yet: nothing has run
            return 0
        row = rows.fetchone()
        return int(row[0]) if row else 0


class Lease:
    """Who among the gateways sharing a database does the work only one should do (marking
    a gone node's sandboxes lost): the holder of a PostgreSQL advisory lock, held by its
    session, so a gateway that dies lets it go and another takes it at its next `held()`.
    On SQLite (one gateway) always held."""

    def __init__(self, where: str | Path, name: str) -> None:
        self.url = str(where) if is_postgres(where) else None
        self.key = lock_key(name)
        self._db: Any = None

    def held(self) -> bool:
        if self.url is None:
            return True
        import psycopg

        try:
            if self._db is None or self._db.closed:
                self._db = psycopg.connect(
                    self.url, autocommit=True, connect_timeout=CONNECT_TIMEOUT
                )
                row = self._db.execute("SELECT pg_try_advisory_lock(%s)", (self.key,)).fetchone()
                if not row[0]:
                    self._db.close()
                    self._db = None
                    return False
            self._db.execute("SELECT 1")  # still connected: still held
            return True
        except psycopg.Error:
            if self._db is not None:
                self._db.close()
            self._db = None
            return False

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None


class Locks:
    """Named locks among the gateways sharing a PostgreSQL database (one replica refreshed
    by one gateway at a time): advisory locks held by one session of this process, so a
    gateway that dies lets its locks go. On SQLite (one gateway) always granted; within a
    process its callers serialise themselves (a session's advisory lock is re-entrant)."""

    def __init__(self, where: str | Path) -> None:
        self.url = str(where) if is_postgres(where) else None
        self._db: Any = None
        self._lock = threading.Lock()

    def _run(self, sql: str, name: str) -> bool:
        import psycopg

        with self._lock:
            try:
                if self._db is None or self._db.closed:
                    self._db = psycopg.connect(
                        str(self.url), autocommit=True, connect_timeout=CONNECT_TIMEOUT
                    )
                return bool(self._db.execute(sql, (lock_key(name),)).fetchone()[0])
            except psycopg.Error:  # a lost session held nothing: its locks went with it
                if self._db is not None:
                    self._db.close()
                self._db = None
                return False

    def try_hold(self, name: str) -> bool:
        """Whether `name` is held here now (False: another gateway holds it)."""
        return self.url is None or self._run("SELECT pg_try_advisory_lock(%s)", name)

    def release(self, name: str) -> None:
        if self.url is not None:
            self._run("SELECT pg_advisory_unlock(%s)", name)

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None


class Presence:
    """That this process lives, as the others sharing a PostgreSQL database can tell: an
    advisory lock on its own id, held by its session, which its death lets go. On SQLite
    (one process) nobody asks."""

    def __init__(self, where: str | Path) -> None:
        self.url = str(where) if is_postgres(where) else None
        self.id = uuid.uuid4().hex if self.url is not None else None
        self._held: Any = None  # the session holding this process's own lock
        self._asking: Any = None  # the one that asks about others
        self._lock = threading.Lock()

    def hold(self) -> None:
        if self.url is None or self._held is not None:
            return
        import psycopg

        self._held = psycopg.connect(self.url, autocommit=True, connect_timeout=CONNECT_TIMEOUT)
        self._held.execute("SELECT pg_advisory_lock(%s)", (lock_key(f"presence:{self.id}"),))

    def alive(self, other: str) -> bool:
        """Whether the process `other` still holds its lock (else it is gone)."""
        if self.url is None:
            return False
        import psycopg

        key = lock_key(f"presence:{other}")
        with self._lock:
            if self._asking is None or self._asking.closed:
                self._asking = psycopg.connect(
                    self.url, autocommit=True, connect_timeout=CONNECT_TIMEOUT
                )
            row = self._asking.execute("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone()
            if row[0]:  # nobody held it: gone (and not ours to keep)
                self._asking.execute("SELECT pg_advisory_unlock(%s)", (key,))
            return not row[0]

    def close(self) -> None:
        for db in (self._held, self._asking):
            if db is not None:
                db.close()
        self._held = self._asking = None
