"""Backups: `cella backup` of a daemon while it serves (a key, a sealed secret, a stopped
sandbox, a running one, a snapshot), `cella restore` into a fresh data directory, and a
new daemon there that lists them, resumes the sandboxes with their files, forks the
snapshot and unseals the secret (the egress proxy adds it toward a loopback server).
Controls: a restore without the secrets key, or with another key, is refused before it
writes anything; with the key it goes through."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from cella import Client, errors
from tests.daemon import Daemon, DaemonFactory
from tests.netservers import EchoHandler, Recorder, Servers, free_loopback_block

pytestmark = pytest.mark.vm

SECRET = "backup-s3cr3t-77a2"


@pytest.fixture(scope="module")
def web() -> Iterator[tuple[str, Recorder]]:
    prefix = free_loopback_block()
    servers = Servers()
    seen = servers.start(EchoHandler, (f"{prefix}.1", 80))
    yield prefix, seen
    servers.close()


@pytest.fixture(scope="module")
def settings(web: tuple[str, Recorder]) -> dict[str, str]:
    return {"pool_size": "0", "egress_hosts": json.dumps({"web.test": f"{web[0]}.1"})}


@pytest.fixture(scope="module")
def source(settings: dict[str, str], module_daemon_factory: DaemonFactory) -> Daemon:
    return module_daemon_factory("source", **settings)


@pytest.fixture(scope="module")
def made(source: Daemon) -> dict[str, str]:
    """What the source daemon holds when it is backed up."""
    with source.client() as client:
        key = client.create_key("acme")["key"]
        client.put_secret("token", SECRET, ["web.test"], auth="bearer")
        stopped = client.create(allow=["web.test"], secrets={"TOKEN": "token"}, name="kept")
        stopped.files.write("/workspace/kept.txt", "written before the backup")
        snap = stopped.snapshot("before")
        stopped.files.write("/workspace/after-snapshot.txt", "only in the sandbox")
        stopped.stop()
        running = client.create(name="busy")
        running.files.write("/workspace/live.txt", "written while it runs")
    return {"key": key, "stopped": stopped.id, "running": running.id, "snapshot": snap.id}


def cella(daemon: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    """The CLI as an operator runs it (its messages with rich's line wrapping undone)."""
    done = subprocess.run(
        [sys.executable, "-m", "cella.cli", *args],
        env=daemon.env(),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    done.stderr = " ".join(done.stderr.split())
    return done


def test_backup_while_serving_then_restore_on_a_fresh_data_dir(
    source: Daemon,
    made: dict[str, str],
    web: tuple[str, Recorder],
    settings: dict[str, str],
    daemon_factory: DaemonFactory,
    tmp_path: Path,
) -> None:
    dest = tmp_path / "backup"
    done = cella(source, "backup", str(dest), "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["secrets_key"] == "excluded" and report["sealed_values"] == 1
    assert report["sandboxes"][made["stopped"]] == {"state": "stopped", "restored_as": "stopped"}
    assert report["sandboxes"][made["running"]] == {"state": "running", "restored_as": "stopped"}
    assert report["snapshots"] == [made["snapshot"]]
    assert not (dest / "data" / "secrets.key").exists()
    manifest = json.loads((dest / "backup.json").read_text())
    assert manifest["version"] and manifest["files"]["data/cella.db"]["sha256"]
    with source.client() as client:  # the source serves on, its running sandbox running
        busy = client.get(made["running"])
        assert busy.state == "running"
        assert busy.exec("echo on").stdout == b"on\n"

    target = tmp_path / "restored"
    # control: without the key the restore says what it needs, and writes nothing
    refused = cella(source, "restore", str(dest), "--data-dir", str(target))
    assert refused.returncode == 1
    assert "secrets key" in refused.stderr and "--secrets-key-file" in refused.stderr
    assert not target.exists()
    wrong = tmp_path / "wrong.key"
    wrong.write_bytes(os.urandom(32))
    refused = cella(
        source, "restore", str(dest), "--data-dir", str(target), "--secrets-key-file", str(wrong)
    )
    assert refused.returncode == 1 and "does not open" in refused.stderr
    assert not target.exists()

    restored = cella(
        source,
        "restore",
        str(dest),
        "--data-dir",
        str(target),
        "--secrets-key-file",
        str(source.data_dir / "secrets.key"),
        "--json",
    )
    assert restored.returncode == 0, restored.stderr
    # a restore refuses a data directory that is not empty
    again = cella(source, "restore", str(dest), "--data-dir", str(target))
    assert again.returncode == 1 and "not empty" in again.stderr

    new = daemon_factory("restored", data_dir=target, **settings)
    seen = web[1]
    with new.client() as client:
        listed = {s.id: s.state for s in client.list()}
        assert listed == {made["stopped"]: "stopped", made["running"]: "stopped"}
        kept = client.get(made["stopped"])
        kept.resume()
        assert kept.files.read("/workspace/kept.txt") == b"written before the backup"
        assert kept.files.read("/workspace/after-snapshot.txt") == b"only in the sandbox"
        # the sealed secret opens: the proxy adds it toward its host
        before = len(seen.requests)
        result = kept.exec("curl -sSf http://web.test/restored", timeout=60)
        assert result.exit_code == 0, result.stderr
        assert seen.requests[before]["headers"]["authorization"] == f"Bearer {SECRET}"
        busy = client.get(made["running"])
        busy.resume()
        assert busy.files.read("/workspace/live.txt") == b"written while it runs"
        (fork,) = client.get_snapshot(made["snapshot"]).fork()
        assert fork.files.read("/workspace/kept.txt") == b"written before the backup"
        assert not fork.files.exists("/workspace/after-snapshot.txt")
        for sandbox in (kept, busy, fork):
            sandbox.delete()
    with new.client(made["key"]) as tenant:  # the tenant's key still works
        assert tenant.list() == []


def test_a_backup_with_its_secrets_key_restores_without_one(
    source: Daemon, made: dict[str, str], tmp_path: Path
) -> None:
    with source.client() as client:
        report = client.backup(str(tmp_path / "backup"), with_secrets_key=True)
        assert report["secrets_key"] == "included"
        with pytest.raises(errors.InvalidArgument, match="not an empty directory"):
            client.backup(str(tmp_path / "backup"))
        with pytest.raises(errors.InvalidArgument, match="inside the data directory"):
            client.backup(str(source.data_dir / "inside"))
    key = (tmp_path / "backup" / "data" / "secrets.key").read_bytes()
    assert key == (source.data_dir / "secrets.key").read_bytes()
    done = cella(
        source, "restore", str(tmp_path / "backup"), "--data-dir", str(tmp_path / "r"), "--json"
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["secrets_key"] == "from the backup"
    assert (tmp_path / "r" / "secrets.key").read_bytes() == key
    # a damaged backup is refused before anything is written
    db = tmp_path / "backup" / "data" / "cella.db"
    db.chmod(0o600)
    with db.open("r+b") as f:
        f.seek(200)
        f.write(b"\xff" * 64)
    broken = cella(source, "restore", str(tmp_path / "backup"), "--data-dir", str(tmp_path / "x"))
    assert broken.returncode == 1 and "checksum" in broken.stderr
    assert not (tmp_path / "x").exists()


def test_backups_are_for_admins(source: Daemon, made: dict[str, str], tmp_path: Path) -> None:
    with Client(source.url, made["key"]) as tenant, pytest.raises(errors.PermissionDenied):
        tenant.backup(str(tmp_path / "b"))
    assert not (tmp_path / "b").exists()
