"""Backups of a fleet gateway's data directory (`cella backup` against a gateway).

A gateway runs no sandbox: its state is its SQLite databases (`gateway.db`: keys, sealed
secrets, registries, webhooks, eval runs; the placements, grants, homes, templates and
rewrites beside it) and its key files. A backup of it has the layout and manifest of a node
daemon's (`service/backups.py`), marked `kind: gateway`, so `cella restore` reads it the
same way. The sandboxes and snapshots stay on the nodes (back those up there); a gateway
restored on a fresh data directory finds them again as it joins the nodes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

from cella.service.backups import (
    DATA,
    BackupReport,
    Progress,
    _quiet,
    check_destination,
    copy_databases,
    copy_key_files,
    finish,
    new_report,
    sealed_values,
)
from cella.store import Store
from cella.store.sealing import KeyFile

STORE = "gateway.db"


class GatewayBackups:
    def __init__(self, root: Path, store: Store, secrets_key: Callable[[], KeyFile | None]) -> None:
        self.root = root
        self.store = store
        self.secrets_key = secrets_key
        self._running = asyncio.Lock()

    def check(self, dest: Path) -> Path:
        return check_destination(self.root, dest, self._running)

    async def backup(
        self, dest: Path, *, with_secrets_key: bool = False, progress: Progress = _quiet
    ) -> BackupReport:
        dest = self.check(dest)
        async with self._running:
            started = time.monotonic()
            key = self.secrets_key()
            schema = self.store.schema_version
            report = new_report(dest, schema, key, with_secrets_key, kind="gateway", store=STORE)
            data = dest / DATA
            data.mkdir(parents=True, exist_ok=True)
            dest.chmod(0o700)
            progress("databases", 0, 1)
            copy = await asyncio.to_thread(copy_databases, self.root, data, STORE)
            try:
                report.sealed_values = sealed_values(copy)
            finally:
                copy.close()
            progress("databases", 1, 1)
            progress("keys", 0, 1)
            await asyncio.to_thread(
                copy_key_files, self.root, data, key if with_secrets_key else None
            )
            await asyncio.to_thread(finish, dest, report, started, progress)
            return report
