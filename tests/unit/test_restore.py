"""`cella restore`'s checks, on a backup made here without VMs: a backup with sealed
secrets restores only with the key they were sealed with, a damaged or incomplete backup
and a data directory in use are refused, and nothing is written when it refuses."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cella import errors
from cella.service.backups import DATA, FORMAT, MANIFEST, _quiet, checksums
from cella.service.restore import restore
from cella.store import SecretRecord, Store
from cella.store.sealing import Sealer, new_key


@pytest.fixture()
def key() -> bytes:
    return new_key()


@pytest.fixture()
def backup(tmp_path: Path, key: bytes) -> Path:
    dest = tmp_path / "backup"
    (dest / DATA).mkdir(parents=True)
    store = Store(dest / DATA / "cella.db")
    store.seal_with(Sealer(key))
    store.put_secret(SecretRecord("acme", "token", "s3cr3t", ["example.com"]))
    store.close()
    (dest / DATA / "admin.key").write_text("ck_admin\n")
    files = checksums(dest, _quiet)
    manifest = {
        "format": FORMAT,
        "version": "0.2.0",
        "secrets_key": "excluded",
        "sealed_values": 1,
        "sandboxes": {},
        "snapshots": [],
        "files": files,
    }
    (dest / MANIFEST).write_text(json.dumps(manifest))
    return dest


def key_file(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / f"key-{data[:4].hex()}"
    path.write_bytes(data)
    return path


def test_sealed_secrets_need_their_key(backup: Path, key: bytes, tmp_path: Path) -> None:
    target = tmp_path / "restored"
    with pytest.raises(errors.InvalidArgument, match="--secrets-key-file"):
        restore(backup, target)
    assert not target.exists()
    with pytest.raises(errors.InvalidArgument, match="does not open"):
        restore(backup, target, secrets_key_file=key_file(tmp_path, new_key()))
    with pytest.raises(errors.InvalidArgument, match="holds 3 bytes"):
        restore(backup, target, secrets_key_file=key_file(tmp_path, b"abc"))
    assert not target.exists()
    report = restore(backup, target, secrets_key_file=key_file(tmp_path, key))
    assert report.files == 2
    assert (target / "secrets.key").read_bytes() == key
    assert (target / "secrets.key").stat().st_mode & 0o777 == 0o600
    assert (target / "admin.key").read_text() == "ck_admin\n"
    store = Store(target / "cella.db")
    store.seal_with(Sealer(key))  # the restored daemon opens its secrets with it
    secret = store.get_secret("acme", "token")
    assert secret is not None and secret.value == "s3cr3t"
    store.close()


def test_a_used_data_directory_is_refused_unless_forced(
    backup: Path, key: bytes, tmp_path: Path
) -> None:
    given = key_file(tmp_path, key)
    target = tmp_path / "used"
    (target / "images").mkdir(parents=True)  # what `cella setup` leaves: still fresh
    restore(backup, target, secrets_key_file=given)
    (target / "cella.db-wal").write_bytes(b"stale")
    with pytest.raises(errors.InvalidArgument, match="not empty"):
        restore(backup, target, secrets_key_file=given)
    restore(backup, target, secrets_key_file=given, force=True)
    assert not (target / "cella.db-wal").exists()  # the old journal went with the old db


def test_a_damaged_or_incomplete_backup_is_refused(
    backup: Path, key: bytes, tmp_path: Path
) -> None:
    given = key_file(tmp_path, key)
    (backup / DATA / "admin.key").write_text("ck_other\n")
    with pytest.raises(errors.SnapshotCorrupt, match=r"admin\.key does not match"):
        restore(backup, tmp_path / "a", secrets_key_file=given)
    os.remove(backup / DATA / "admin.key")
    with pytest.raises(errors.SnapshotCorrupt, match=r"lacks data/admin\.key"):
        restore(backup, tmp_path / "a", secrets_key_file=given)
    (backup / MANIFEST).unlink()
    with pytest.raises(errors.InvalidArgument, match="not a complete cella backup"):
        restore(backup, tmp_path / "a", secrets_key_file=given)
    assert not (tmp_path / "a").exists()
