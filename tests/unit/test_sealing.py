"""Secret values sealed at rest: what the database file holds, rotation and its crash
points, values moved between rows, a wrong key."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from cella import errors
from cella.store import Store, WebhookRecord
from cella.store.records import SecretRecord
from cella.store.sealing import KeyFile, Sealer, new_key

VALUE = "s3cr3t-Value-+/=-4b1d"


def secret(name: str = "api", value: str = VALUE) -> SecretRecord:
    return SecretRecord("acme", name, value, ["api.test"], None, "x-access-token", "anywhere")


def on_disk(db: Path) -> bytes:
    """Everything SQLite keeps for the database: the file, its WAL and shared memory."""
    return b"".join(p.read_bytes() for p in db.parent.glob(db.name + "*"))


@pytest.fixture
def store(tmp_path: Path) -> Store:
    s = Store(tmp_path / "cella.db")
    s.seal_with(KeyFile(tmp_path / "secrets.key").load(s.opens_with))
    return s


def test_the_database_never_holds_a_value(store: Store, tmp_path: Path) -> None:
    store.put_secret(secret())
    assert store.get_secret("acme", "api").value == VALUE  # type: ignore[union-attr]
    raw = on_disk(tmp_path / "cella.db")
    assert b"api.test" in raw  # control: the scan sees the row
    assert VALUE.encode() not in raw and VALUE[:8].encode() not in raw
    key = tmp_path / "secrets.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and len(key.read_bytes()) == 32


def test_values_from_an_older_version_are_sealed_at_start(tmp_path: Path) -> None:
    old = Store(tmp_path / "cella.db")
    old._sealer = None
    old._exec(
        "INSERT INTO secrets (tenant, name, value, hosts, auth, username, inject, created_at, "
        "updated_at) VALUES ('acme', 'api', ?, '[]', NULL, 'x', 'anywhere', '', '')",
        (VALUE,),
    )
    assert VALUE.encode() in on_disk(tmp_path / "cella.db")  # control: it was in clear
    new = Store(tmp_path / "cella.db")
    new.seal_with(KeyFile(tmp_path / "secrets.key").load(new.opens_with))
    new._exec("PRAGMA wal_checkpoint(TRUNCATE)")
    new._exec("VACUUM")  # the old page is rewritten, not just marked free
    assert VALUE.encode() not in on_disk(tmp_path / "cella.db")
    assert new.get_secret("acme", "api").value == VALUE  # type: ignore[union-attr]


def test_rotation_keeps_values_and_retires_the_old_key(store: Store, tmp_path: Path) -> None:
    store.put_secret(secret())
    store.put_secret(secret("gh", "other-value"))
    key_file = KeyFile(tmp_path / "secrets.key")
    old = Sealer(key_file.path.read_bytes())
    key_file.rotate(store)
    assert not key_file.next.exists()
    assert not store.opens_with(old)
    assert store.opens_with(Sealer(key_file.path.read_bytes()))
    assert store.get_secret("acme", "gh").value == "other-value"  # type: ignore[union-attr]
    again = Store(tmp_path / "cella.db")  # a restart reads the new key
    again.seal_with(key_file.load(again.opens_with))
    assert again.get_secret("acme", "api").value == VALUE  # type: ignore[union-attr]


def test_a_rotation_stopped_before_or_after_its_commit(store: Store, tmp_path: Path) -> None:
    store.put_secret(secret())
    key_file = KeyFile(tmp_path / "secrets.key")
    # stopped after writing the next key, before the commit: the old key holds
    key_file.next.write_bytes(new_key())
    restarted = Store(tmp_path / "cella.db")
    restarted.seal_with(key_file.load(restarted.opens_with))
    assert not key_file.next.exists()
    assert restarted.get_secret("acme", "api").value == VALUE  # type: ignore[union-attr]
    # stopped after the commit, before the key file was replaced: the next key is taken
    following = new_key()
    key_file.next.write_bytes(following)
    restarted.reseal(Sealer(following))
    again = Store(tmp_path / "cella.db")
    again.seal_with(key_file.load(again.opens_with))
    assert key_file.path.read_bytes() == following and not key_file.next.exists()
    assert again.get_secret("acme", "api").value == VALUE  # type: ignore[union-attr]


def test_a_failed_reseal_changes_nothing(store: Store, tmp_path: Path) -> None:
    store.put_secret(secret())
    store.put_secret(secret("b"))
    foreign = Sealer(new_key()).seal("x", "acme/b")  # a value this key cannot open
    store._exec("UPDATE secrets SET value = ? WHERE name = 'b'", (foreign,))
    before = store._exec("SELECT name, value FROM secrets ORDER BY name").fetchall()
    with pytest.raises(errors.HostError):
        store.reseal(Sealer(new_key()))
    after = store._exec("SELECT name, value FROM secrets ORDER BY name").fetchall()
    assert [tuple(r) for r in before] == [tuple(r) for r in after]


def test_a_value_moved_to_another_row_does_not_open(store: Store) -> None:
    store.put_secret(secret("a", "value-of-a"))
    store.put_secret(secret("b", "value-of-b"))
    sealed_a = store._exec("SELECT value FROM secrets WHERE name = 'a'").fetchone()[0]
    store._exec("UPDATE secrets SET value = ? WHERE name = 'b'", (sealed_a,))
    with pytest.raises(errors.HostError, match="does not open"):
        store.get_secret("acme", "b")
    assert store.get_secret("acme", "a").value == "value-of-a"  # type: ignore[union-attr]


def test_a_wrong_key_file_is_refused_at_start(store: Store, tmp_path: Path) -> None:
    store.put_secret(secret())
    (tmp_path / "secrets.key").write_bytes(new_key())
    again = Store(tmp_path / "cella.db")
    with pytest.raises(errors.HostError, match="does not open"):
        again.seal_with(KeyFile(tmp_path / "secrets.key").load(again.opens_with))


def test_webhook_secrets_are_sealed_and_rotated(store: Store, tmp_path: Path) -> None:
    hook = WebhookRecord("wh-1", "acme", "n", "http://hooks.test/", ["sandbox.killed"], VALUE)
    store.put_webhook(hook)
    raw = on_disk(tmp_path / "cella.db")
    assert b"hooks.test" in raw and VALUE.encode() not in raw  # the row, not the secret
    key_file = KeyFile(tmp_path / "secrets.key")
    old = Sealer(key_file.path.read_bytes())
    key_file.rotate(store)
    assert not store.opens_with(old)  # the webhook's secret was resealed with the rest
    again = Store(tmp_path / "cella.db")
    again.seal_with(key_file.load(again.opens_with))
    assert again.get_webhook("acme", "wh-1").secret == VALUE  # type: ignore[union-attr]
    assert again.get_webhook("other", "wh-1") is None  # another tenant's id is nothing
