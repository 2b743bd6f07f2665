"""A throwaway PostgreSQL server (Debian's) on loopback, for the tests of shared state.

`initdb` and `pg_ctl` run as the `postgres` user in a temporary directory; the server
listens on 127.0.0.1 and a socket in that directory, trusts local connections, and is
stopped (and its directory removed) at the end.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

BIN = Path("/usr/lib/postgresql/15/bin")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _as_postgres(*cmd: str) -> None:
    subprocess.run(
        ["runuser", "-u", "postgres", "--", *cmd],
        check=True,
        capture_output=True,
        timeout=120,
    )


@contextlib.contextmanager
def postgres_server() -> Iterator[str]:
    """A running server; yields the URL of its `postgres` database."""
    if not (BIN / "initdb").exists() or shutil.which("runuser") is None or os.geteuid() != 0:
        pytest.skip("needs Debian's postgresql 15 and root (to run it as `postgres`)")
    root = Path(tempfile.mkdtemp(prefix="cella-pg-"))
    shutil.chown(root, "postgres", "postgres")
    data = root / "data"
    _as_postgres(str(BIN / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres")
    for attempt in range(3):  # a free port found here may be taken before the server binds
        port = _free_port()
        options = f"-k {root} -c listen_addresses=127.0.0.1 -p {port} -c fsync=off"
        try:
            _as_postgres(str(BIN / "pg_ctl"), "-D", str(data), "-o", options, "-w", "-l",
                         str(root / "log"), "start")  # fmt: skip
            break
        except subprocess.CalledProcessError:
            log = (root / "log").read_text(errors="replace")[-2000:]
            if attempt == 2:
                raise RuntimeError(f"PostgreSQL did not start: {log}") from None
    try:
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    finally:
        with contextlib.suppress(subprocess.SubprocessError):
            _as_postgres(str(BIN / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop")
        shutil.rmtree(root, ignore_errors=True)


def fresh_database(url: str, name: str) -> str:
    """A new empty database on the server at `url`; its URL."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as db:
        db.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        db.execute(f'CREATE DATABASE "{name}"')
    return url.rsplit("/", 1)[0] + "/" + name
