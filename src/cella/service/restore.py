"""Restoring a backup (`service/backups.py`) into a fresh data directory, with no daemon
running there. Every file is checked against the backup's manifest, and the secrets key
against the sealed values, before anything is written; a daemon started on the directory
then lists the sandboxes (stopped: resumed on request) and forks the snapshots."""

from __future__ import annotations

import json
import shutil
import sqlite3
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cella import errors
from cella.service.backups import DATA, FORMAT, MANIFEST, SECRETS_KEY, Progress, _quiet, copy_file
from cella.storage.snapshots import sha256_of
from cella.store import Store
from cella.store.sealing import KEY_BYTES, Sealer

FRESH = {"images", "tmp"}  # what `cella setup` leaves in a data directory before any daemon


@dataclass
class RestoreReport:
    data_dir: str
    version: str
    sandboxes: dict[str, dict[str, Any]] = field(default_factory=dict)
    snapshots: list[str] = field(default_factory=list)
    secrets_key: str = "none needed"  # from the backup, from a file, a command's, none needed
    files: int = 0
    kind: str = "daemon"  # or "gateway": a fleet gateway's data directory

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def read_manifest(src: Path) -> dict[str, Any]:
    try:
        manifest: dict[str, Any] = json.loads((src / MANIFEST).read_text())
    except FileNotFoundError:
        raise errors.InvalidArgument(
            f"{src} is not a complete cella backup (no {MANIFEST}: an interrupted backup?)"
        ) from None
    except (OSError, ValueError) as exc:
        raise errors.InvalidArgument(f"{src / MANIFEST}: {exc}") from None
    if manifest.get("format") != FORMAT:
        raise errors.InvalidArgument(
            f"{src} is a backup of format {manifest.get('format')!r}; this release reads {FORMAT}"
        )
    return manifest


def restore(
    src: Path,
    data_dir: Path,
    *,
    secrets_key_file: Path | None = None,
    force: bool = False,
    progress: Progress = _quiet,
) -> RestoreReport:
    """Writes the backup at `src` into `data_dir`, which must be empty (or absent) unless
    `force` (then what the backup holds replaces what is there)."""
    src, data_dir = src.resolve(), data_dir.resolve()
    manifest = read_manifest(src)
    if not force and any(e.name not in FRESH for e in _entries(data_dir)):
        raise errors.InvalidArgument(
            f"{data_dir} is not empty: restore into a fresh data directory (or --force to "
            "replace what is there)"
        )
    files: dict[str, dict[str, Any]] = manifest["files"]
    _verify(src, files, progress)
    key, key_source = _secrets_key(src, manifest, secrets_key_file)
    report = RestoreReport(
        str(data_dir),
        manifest["version"],
        manifest.get("sandboxes", {}),
        manifest.get("snapshots", []),
        key_source,
        len(files),
        manifest.get("kind", "daemon"),
    )
    data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    if force:
        _clear(data_dir, src / DATA)
    names = [name for name in files if name != f"{DATA}/{SECRETS_KEY}"]
    for done, name in enumerate(names):
        progress("files", done, len(names))
        copy_file(src / name, data_dir / Path(name).relative_to(DATA))
    progress("files", len(names), len(names))
    for directory in [data_dir, *(p for p in data_dir.rglob("*") if p.is_dir())]:
        directory.chmod(0o700)
    if key is not None:
        target = data_dir / SECRETS_KEY
        target.unlink(missing_ok=True)
        target.touch(mode=0o600)
        target.write_bytes(key)
    return report


def _entries(directory: Path) -> list[Path]:
    return list(directory.iterdir()) if directory.is_dir() else []


def _verify(src: Path, files: dict[str, dict[str, Any]], progress: Progress) -> None:
    for done, (name, expected) in enumerate(sorted(files.items())):
        progress("verify", done, len(files))
        path = src / name
        if not path.is_file():
            raise errors.SnapshotCorrupt(f"the backup lacks {name}")
        if sha256_of(path) != expected["sha256"]:
            raise errors.SnapshotCorrupt(f"the backup's {name} does not match its checksum")
    progress("verify", len(files), len(files))


def _secrets_key(
    src: Path, manifest: dict[str, Any], given: Path | None
) -> tuple[bytes | None, str]:
    """The key the restored directory gets, and where it came from. Sealed values need it
    (else the restored daemon would refuse to start); one that does not open them is
    refused here, before anything is written."""
    sealed = int(manifest.get("sealed_values", 0))
    included = src / DATA / SECRETS_KEY
    if given is not None:
        key, source = _read_key(given), f"from {given}"
    elif included.exists():
        key, source = included.read_bytes(), "from the backup"
    elif manifest.get("secrets_key") == "command":
        return None, "secrets_key_command (configure the restored daemon with it)"
    elif sealed:
        raise errors.InvalidArgument(
            f"the backup holds {sealed} sealed secret value(s) but not the secrets key they "
            "were sealed with (made without --with-secrets-key): restore with "
            "--secrets-key-file naming that key (the source's secrets.key)"
        )
    else:
        return None, "none needed"
    store = manifest.get("store", "cella.db")  # a gateway's are in gateway.db
    if sealed and not _opens(src / DATA / store, key):
        raise errors.InvalidArgument(
            f"the secrets key {source.removeprefix('from ')} does not open the backup's "
            "sealed secrets: it is not the key they were sealed with"
        )
    return key, source


def _read_key(path: Path) -> bytes:
    try:
        key = path.read_bytes()
    except OSError as exc:
        raise errors.InvalidArgument(f"secrets key file {path}: {exc.strerror}") from None
    if len(key) != KEY_BYTES:
        raise errors.InvalidArgument(
            f"secrets key file {path} holds {len(key)} bytes; a secrets key is {KEY_BYTES}"
        )
    return key


def _opens(db: Path, key: bytes) -> bool:
    """Whether `key` opens the sealed values of a copy of `db` (the backup stays as is)."""
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / db.name
        source, target = sqlite3.connect(db), sqlite3.connect(copy)
        try:
            source.backup(target)
        finally:
            source.close()
            target.close()
        store = Store(copy)
        try:
            return store.opens_with(Sealer(key))
        finally:
            store.close()


def _clear(data_dir: Path, data: Path) -> None:
    """--force: what the backup holds replaces what is there (databases' journals too)."""
    for entry in data.iterdir():
        there = data_dir / entry.name
        for old in (
            there,
            there.with_name(f"{there.name}-wal"),
            there.with_name(f"{there.name}-shm"),
        ):
            if old.is_dir() and not old.is_symlink():
                shutil.rmtree(old)
            else:
                old.unlink(missing_ok=True)
