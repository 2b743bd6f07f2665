"""A fleet gateway's backup, made here without a cluster: its databases (a sealed secret in
gateway.db, a placement beside it) and keys, taken while the databases are open and being
written, restored into a fresh data directory only with the secrets key the secret was
sealed with. The fleet's own check (`tests/fleet/ops_checks.py`) starts a gateway on it."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path

import pytest

from cella import errors
from cella.fleet.backups import GatewayBackups
from cella.fleet.placement_table import Placements
from cella.service.backups import MANIFEST
from cella.service.restore import restore
from cella.store import SecretRecord, Store
from cella.store.sealing import KeyFile, Sealer, seal_store


@pytest.fixture()
def gateway(tmp_path: Path) -> tuple[Path, Store, KeyFile]:
    root = tmp_path / "gateway"
    root.mkdir()
    store = Store(root / "gateway.db")
    key = seal_store(store, root / "secrets.key", None)
    assert key is not None
    store.put_secret(SecretRecord("acme", "token", "s3cr3t", ["example.com"]))
    (root / "admin.key").write_text("ck_admin\n")
    (root / "session.key").write_bytes(b"k" * 32)
    (root / "daemon.log").write_text("not state\n")
    return root, store, key


def test_a_gateway_backup_restores_with_its_key(
    gateway: tuple[Path, Store, KeyFile], tmp_path: Path
) -> None:
    root, store, key = gateway
    placements = Placements(root / "placements.db")
    placements.put("n2", {"id": "sb-1", "tenant": "acme"})  # WAL mode: the copy holds it
    backups = GatewayBackups(root, store, lambda: key)
    dest = tmp_path / "backup"
    seen: list[str] = []
    report = asyncio.run(backups.backup(dest, progress=lambda step, _d, _t: seen.append(step)))
    assert report.kind == "gateway" and report.store == "gateway.db"
    assert report.secrets_key == "excluded" and report.sealed_values == 1
    assert {"databases", "keys", "checksums"} <= set(seen)
    manifest = json.loads((dest / MANIFEST).read_text())
    held = set(manifest["files"])
    assert {"data/gateway.db", "data/placements.db", "data/admin.key", "data/session.key"} <= held
    assert "data/secrets.key" not in held and "data/daemon.log" not in held
    with pytest.raises(errors.InvalidArgument, match="not an empty directory"):
        backups.check(dest)  # the control: a second backup does not overwrite the first

    target = tmp_path / "restored"
    with pytest.raises(errors.InvalidArgument, match="--secrets-key-file"):
        restore(dest, target)
    assert not target.exists()
    done = restore(dest, target, secrets_key_file=key.path)
    assert done.kind == "gateway"
    assert (target / "admin.key").read_text() == "ck_admin\n"
    restored = Store(target / "gateway.db")
    restored.seal_with(Sealer((target / "secrets.key").read_bytes()))
    secret = restored.get_secret("acme", "token")
    assert secret is not None and secret.value == "s3cr3t"
    restored.close()
    with sqlite3.connect(target / "placements.db") as db:
        rows = db.execute("SELECT sandbox_id, node FROM placements").fetchall()
    assert rows == [("sb-1", "n2")]


def test_a_gateway_backup_with_its_key_restores_without_one(
    gateway: tuple[Path, Store, KeyFile], tmp_path: Path
) -> None:
    root, store, key = gateway
    backups = GatewayBackups(root, store, lambda: key)
    report = asyncio.run(backups.backup(tmp_path / "backup", with_secrets_key=True))
    assert report.secrets_key == "included"
    done = restore(tmp_path / "backup", tmp_path / "restored")
    assert done.secrets_key == "from the backup"
    assert (tmp_path / "restored" / "secrets.key").read_bytes() == key.path.read_bytes()
