"""Backups of a running daemon's data directory, consistent while it serves.

A backup is a directory: `data/` laid out as the data directory it came from, and
`backup.json` (written last: its presence means complete) with the release and schema that
wrote it, what became of each sandbox, and a checksum of every file. What goes in:

- every SQLite database of the directory (`cella.db`, a gateway's others), copied with
  SQLite's backup API, so each is one consistent state;
- the keys (API admin key, session and service keys, signing keys, the egress CA guests
  trust); the sealed secrets' key only when the operator asks (`with_secrets_key`), else the
  restore needs it given (`cella restore --secrets-key-file`);
- every ready snapshot, its disk made to stand alone (`qemu-img convert` of the chain);
- every sandbox's disk, standing alone: a stopped one as it is (under its lock, so nothing
  resumes it meanwhile); a running one flushed (`sync`) and paused for the copy, then run
  on; it comes back stopped, its disk as a power cut would have left it. A sandbox that
  was being made, stopped or removed is left out and marked `error` in the copy;
- volumes' files.

The database copy is taken first; each sandbox and snapshot is then written into the copy
as what the backup holds of it, so the copy never names files the backup lacks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import sqlite3
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cella import __version__, errors
from cella.models import SandboxState
from cella.service.registry import Registry
from cella.storage.overlay import flatten_image
from cella.storage.snapshots import SnapshotDir, sha256_of
from cella.store.sealing import KeyFile

log = logging.getLogger("cella.backups")
S = SandboxState
FORMAT = "cella-backup/1"
MANIFEST = "backup.json"
DATA = "data"
SECRETS_KEY = "secrets.key"
# files of the data directory's top level that are not state (or are written anew)
NOT_STATE = {"daemon.json", "daemon.log", "cella.toml"}
KEY_DIRS = ("signing",)  # copied whole
EGRESS_KEEP = "mitmproxy-ca"  # the deployment CA (guests trust it): its files
SYNC_SECONDS = 20.0

Progress = Callable[[str, int, int], None]  # (step, done, total)


def _quiet(_step: str, _done: int, _total: int) -> None:
    pass


def copy_file(src: Path, dest: Path) -> None:
    """Copies keeping holes (RAM files are mostly holes) and the mode."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["cp", "--sparse=always", "--preserve=mode", str(src), str(dest)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise errors.HostError(f"copying {src}: {done.stderr.strip()}")


def sealed_values(db: sqlite3.Connection) -> int:
    """How many values in this database are sealed under the secrets key."""
    count = 0
    for table, column in (("secrets", "value"), ("registries", "value"), ("webhooks", "secret")):
        with contextlib.suppress(sqlite3.Error):  # a table an older schema lacks
            count += db.execute(
                f"SELECT count(*) FROM {table} WHERE {column} LIKE 'sealed:%'"
            ).fetchone()[0]
    return count


@dataclass
class BackupReport:
    dest: str
    version: str
    schema_version: int
    secrets_key: str  # included, excluded (the restore needs it given) or command
    sealed_values: int
    sandboxes: dict[str, dict[str, Any]] = field(default_factory=dict)
    snapshots: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    files: int = 0
    bytes: int = 0
    seconds: float = 0.0
    kind: str = "daemon"  # or "gateway" (a fleet gateway's: no sandbox, no snapshot)
    store: str = "cella.db"  # the database the sealed values are in

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def new_report(
    dest: Path,
    schema_version: int,
    key: KeyFile | None,
    with_secrets_key: bool,
    kind: str = "daemon",
    store: str = "cella.db",
) -> BackupReport:
    """A backup's report as it starts: this release's, and where its secrets key goes."""
    where = "command" if key is None else "included" if with_secrets_key else "excluded"
    return BackupReport(str(dest), __version__, schema_version, where, 0, kind=kind, store=store)


def check_destination(root: Path, dest: Path, running: asyncio.Lock) -> Path:
    """`dest` resolved, if a backup of `root` may go there: an absolute path to a new or
    empty directory outside it, while no other backup runs (`running` held)."""
    if not dest.is_absolute():
        raise errors.InvalidArgument(f"the backup's destination {dest} is not absolute")
    dest = dest.resolve()
    if dest == root or root in dest.parents:
        raise errors.InvalidArgument("a backup cannot go inside the data directory")
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise errors.InvalidArgument(f"{dest} is not an empty directory")
    if running.locked():
        raise errors.Conflict("a backup is already under way")
    return dest


def copy_databases(root: Path, data: Path, main: str) -> sqlite3.Connection:
    """Every SQLite database of `root`, each one consistent state (SQLite's backup API);
    returns a connection to the copy of `main`, which the caller may write into."""
    for db in sorted(root.glob("*.db")):
        source = sqlite3.connect(db)
        target = sqlite3.connect(data / db.name)
        try:
            source.backup(target)
        finally:
            source.close()
            target.close()
    copy = sqlite3.connect(data / main, isolation_level=None, check_same_thread=False)
    copy.row_factory = sqlite3.Row
    copy.execute("PRAGMA journal_mode=DELETE")  # one file: nothing beside it to carry
    return copy


def is_state_file(name: str) -> bool:
    """A top-level file worth keeping: keys and the like, not the databases (copied apart),
    their journals, the secrets key (only on request) or what is written anew."""
    skip = name in NOT_STATE or name.startswith(SECRETS_KEY)
    return not (skip or name.endswith((".db", ".db-wal", ".db-shm", ".tmp", ".log")))


def copy_key_files(root: Path, data: Path, key: KeyFile | None) -> None:
    """The keys of `root` (API, session, signing, the egress CA guests trust), and the
    secrets key when given."""
    for entry in sorted(root.iterdir()):
        if entry.is_file() and not entry.is_symlink() and is_state_file(entry.name):
            copy_file(entry, data / entry.name)
    for name in KEY_DIRS:
        if (root / name).is_dir():
            for file in sorted((root / name).rglob("*")):
                if file.is_file():
                    copy_file(file, data / file.relative_to(root))
    for file in sorted((root / "egress").glob(f"{EGRESS_KEEP}*")):
        copy_file(file, data / "egress" / file.name)
    if key is not None:
        copy_file(key.path, data / SECRETS_KEY)


def checksums(dest: Path, progress: Progress) -> dict[str, dict[str, Any]]:
    files = sorted(p for p in (dest / DATA).rglob("*") if p.is_file())
    out: dict[str, dict[str, Any]] = {}
    for done, path in enumerate(files):
        progress("checksums", done, len(files))
        out[str(path.relative_to(dest))] = {"sha256": sha256_of(path), "bytes": path.stat().st_size}
    progress("checksums", len(files), len(files))
    return out


def finish(dest: Path, report: BackupReport, started: float, progress: Progress) -> None:
    """Checksums every file and writes the manifest, last: a backup without it is
    incomplete."""
    files = checksums(dest, progress)
    report.files = len(files)
    report.bytes = sum(f["bytes"] for f in files.values())
    report.seconds = round(time.monotonic() - started, 3)
    manifest = {"format": FORMAT, **report.to_json(), "files": files}
    tmp = dest / f"{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True))
    tmp.rename(dest / MANIFEST)
    log.info("backup to %s: %d files, %d bytes", dest, report.files, report.bytes)


class Backups:
    def __init__(self, registry: Registry, secrets_key: Callable[[], KeyFile | None]) -> None:
        self.registry = registry
        self.root = registry.driver.paths.root
        self.secrets_key = secrets_key
        self._running = asyncio.Lock()

    def check(self, dest: Path) -> Path:
        """Where a backup may go: an absolute path to a new or empty directory outside the
        data directory, while no other backup runs (checked before one starts)."""
        return check_destination(self.root, dest, self._running)

    async def backup(
        self, dest: Path, *, with_secrets_key: bool = False, progress: Progress = _quiet
    ) -> BackupReport:
        """Writes a backup of this daemon's data directory into `dest` (a new or empty
        directory, not inside the data directory)."""
        dest = self.check(dest)
        async with self._running:
            started = time.monotonic()
            key = self.secrets_key()
            report = new_report(dest, self.registry.store.schema_version, key, with_secrets_key)
            data = dest / DATA
            data.mkdir(parents=True, exist_ok=True)
            dest.chmod(0o700)
            progress("databases", 0, 1)
            copy = await asyncio.to_thread(copy_databases, self.root, data, "cella.db")
            try:
                report.sealed_values = sealed_values(copy)
                await self._snapshots(copy, data, report, progress)
                await self._sandboxes(copy, data, report, progress)
            finally:
                copy.close()
            progress("keys and volumes", 0, 1)
            await asyncio.to_thread(
                copy_key_files, self.root, data, key if with_secrets_key else None
            )
            await asyncio.to_thread(self._volumes, data)
            await asyncio.to_thread(finish, dest, report, started, progress)
            return report

    # -- the parts ------------------------------------------------------------------------

    async def _snapshots(
        self, copy: sqlite3.Connection, data: Path, report: BackupReport, progress: Progress
    ) -> None:
        ids = [r["id"] for r in copy.execute("SELECT id FROM snapshots WHERE state = 'ready'")]
        for done, snap_id in enumerate(ids):
            progress("snapshots", done, len(ids))
            try:
                await asyncio.to_thread(self._snapshot, snap_id, data / "snapshots" / snap_id)
                report.snapshots.append(snap_id)
            except (errors.CellaError, OSError) as exc:
                why = f"snapshot {snap_id} left out: {exc}"
                report.warnings.append(why)
                copy.execute(
                    "UPDATE snapshots SET state = 'error', error = ? WHERE id = ?", (why, snap_id)
                )
        progress("snapshots", len(ids), len(ids))

    def _snapshot(self, snap_id: str, target: Path) -> None:
        source = SnapshotDir(self.root / "snapshots" / snap_id)
        for attempt in range(3):  # a layer may be flattened under us: read it again
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir(parents=True)
            manifest = source.manifest()
            try:
                for name in source.files(manifest):
                    if name != source.disk.name:
                        copy_file(source.path / name, target / name)
                flatten_image(source.disk, target / source.disk.name)
                for extra in (source.manifest_path, source.source_path):
                    if extra.exists():
                        copy_file(extra, target / extra.name)
                break
            except (errors.CellaError, OSError):
                if attempt == 2 or source.manifest() == manifest:
                    raise
        standalone = SnapshotDir(target)
        if "sha256" in manifest:
            standalone.reseal(standalone.disk.name)
        for name in standalone.files():
            (target / name).chmod(0o400)

    async def _sandboxes(
        self, copy: sqlite3.Connection, data: Path, report: BackupReport, progress: Progress
    ) -> None:
        rows = copy.execute(
            "SELECT id, state, disk FROM sandboxes WHERE state NOT IN ('deleted', 'error')"
        ).fetchall()
        for done, row in enumerate(rows):
            progress("sandboxes", done, len(rows))
            sandbox_id = row["id"]
            try:
                was = await self._sandbox(sandbox_id, row["disk"], data / "vms" / sandbox_id)
            except (errors.CellaError, OSError) as exc:
                was, why = row["state"], f"left out of the backup: {exc}"
                report.warnings.append(f"sandbox {sandbox_id} {why}")
                copy.execute(
                    "UPDATE sandboxes SET state = 'error', pid = NULL, error = ? WHERE id = ?",
                    (why, sandbox_id),
                )
                report.sandboxes[sandbox_id] = {"state": was, "restored_as": "error"}
                continue
            after = "stopped" if was not in (S.deleted, S.error) else was
            copy.execute(
                "UPDATE sandboxes SET state = ?, pid = NULL WHERE id = ?", (after, sandbox_id)
            )
            report.sandboxes[sandbox_id] = {"state": was, "restored_as": after}
        progress("sandboxes", len(rows), len(rows))

    async def _sandbox(self, sandbox_id: str, disk: str, target: Path) -> str:
        """Copies the sandbox's disk as it is now; returns the state it was in."""
        async with self.registry.lock(sandbox_id):
            row = self.registry.store.get_sandbox(sandbox_id)
            if row is None or row.state in (S.deleted, S.error):
                return str(S.deleted if row is None else row.state)  # gone meanwhile
            source = self.registry.directory(sandbox_id) / disk
            target.mkdir(parents=True, exist_ok=True)
            vm = self.registry.vm(sandbox_id)
            if row.state == S.stopped or (row.state == S.paused and vm is not None):
                await asyncio.to_thread(flatten_image, source, target / disk)
            elif row.state == S.running and vm is not None:
                with contextlib.suppress(errors.CellaError, TimeoutError):
                    await vm.agent.exec(["sync"], timeout=SYNC_SECONDS)  # what it wrote, down
                await vm.pause()
                try:
                    await asyncio.to_thread(flatten_image, source, target / disk)
                finally:
                    await vm.resume()
            else:
                raise errors.InvalidState(f"it was {row.state}")
            return str(row.state)

    def _volumes(self, data: Path) -> None:
        volumes = self.root / "volumes"
        if not volumes.is_dir():
            return
        for file in sorted(volumes.rglob("*")):
            rel = file.relative_to(self.root)
            if file.is_file() and not file.is_symlink() and ".tmp" not in rel.parts:
                copy_file(file, data / rel)
