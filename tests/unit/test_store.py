from pathlib import Path

from cella.store import Store
from cella.store.migrations import MIGRATIONS


def test_migrations_run_in_order_once(tmp_path: Path) -> None:
    store = Store(tmp_path / "x.db")
    assert store.schema_version == len(MIGRATIONS)
    store.close()
    again = Store(tmp_path / "x.db")  # reopening runs nothing twice
    assert again.schema_version == len(MIGRATIONS)


def test_sandbox_rows_round_trip_and_filter(tmp_path: Path) -> None:
    store = Store(tmp_path / "x.db")
    base = {"template": "default", "vcpus": 1, "memory_mib": 512}
    store.insert_sandbox(
        {"id": "sb-a", "tenant": "t1", "state": "running", "labels": {"k": "v"}, **base}
    )
    store.insert_sandbox({"id": "sb-b", "tenant": "t2", "state": "stopped", **base})
    store.update_sandbox("sb-a", state="paused", pid=42)
    row = store.get_sandbox("sb-a")
    assert row is not None and (row["state"], row["pid"], row["labels"]) == (
        "paused",
        42,
        {"k": "v"},
    )
    assert [r["id"] for r in store.list_sandboxes("t1")] == ["sb-a"]
    assert [r["id"] for r in store.list_sandboxes(None, ["stopped"])] == ["sb-b"]
    assert store.get_sandbox("sb-nope") is None


def test_snapshot_users_count_live_dependants_only(tmp_path: Path) -> None:
    store = Store(tmp_path / "x.db")
    snap = {
        "tenant": "t",
        "name": "n",
        "sandbox_id": "sb-a",
        "state": "ready",
        "template": "default",
        "vcpus": 1,
        "memory_mib": 512,
    }
    store.insert_snapshot({"id": "snap-1", **snap})
    store.insert_snapshot({"id": "snap-2", **snap, "parent_snapshot_id": "snap-1"})
    base = {"tenant": "t", "template": "default", "vcpus": 1, "memory_mib": 512}
    store.insert_sandbox({"id": "sb-f", "state": "running", "base_snapshot_id": "snap-1", **base})
    store.insert_sandbox({"id": "sb-g", "state": "deleted", "base_snapshot_id": "snap-1", **base})
    assert store.snapshot_users("snap-1") == (["sb-f"], ["snap-2"])
    store.update_snapshot("snap-2", state="deleted")
    store.update_sandbox("sb-f", state="deleted")
    assert store.snapshot_users("snap-1") == ([], [])
