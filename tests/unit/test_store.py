import sqlite3
from pathlib import Path

import pytest

from cella.models import NetworkPolicy, SandboxState, SnapshotState
from cella.store import SandboxRecord, SecretRef, SnapshotRecord, Store
from cella.store.migrations import MIGRATIONS

S = SandboxState


def sandbox(sandbox_id: str, tenant: str, state: S, **fields: object) -> SandboxRecord:
    return SandboxRecord(
        id=sandbox_id,
        tenant=tenant,
        state=state,
        template="default",
        **{"vcpus": 1, "memory_mib": 512, **fields},  # type: ignore[arg-type]
    )


def snapshot(snapshot_id: str, **fields: object) -> SnapshotRecord:
    return SnapshotRecord(
        id=snapshot_id,
        tenant="t",
        name="n",
        sandbox_id="sb-a",
        state=SnapshotState.ready,
        template="default",
        vcpus=1,
        memory_mib=512,
        **fields,  # type: ignore[arg-type]
    )


def test_migrations_run_in_order_once(tmp_path: Path) -> None:
    store = Store(tmp_path / "x.db")
    assert store.schema_version == len(MIGRATIONS)
    store.close()
    again = Store(tmp_path / "x.db")  # reopening runs nothing twice
    assert again.schema_version == len(MIGRATIONS)


def test_sandbox_rows_round_trip_and_filter(tmp_path: Path) -> None:
    store = Store(tmp_path / "x.db")
    store.insert_sandbox(
        sandbox(
            "sb-a",
            "t1",
            S.running,
            labels={"k": "v"},
            network=NetworkPolicy(allow=["pypi.org"]),
            secrets={"TOKEN": SecretRef("gh", "cella-secret-1")},
        )
    )
    store.insert_sandbox(sandbox("sb-b", "t2", S.stopped))
    store.update_sandbox("sb-a", state="paused", pid=42, network=NetworkPolicy(deny=["x.org"]))
    row = store.get_sandbox("sb-a")
    assert row is not None and (row.state, row.pid, row.labels) == (S.paused, 42, {"k": "v"})
    assert row.network == NetworkPolicy(deny=["x.org"])
    assert row.secrets == {"TOKEN": SecretRef("gh", "cella-secret-1")}
    assert row.created_at and row.updated_at
    assert [r.id for r in store.list_sandboxes("t1")] == ["sb-a"]
    assert [r.id for r in store.list_sandboxes(None, ["stopped"])] == ["sb-b"]
    assert store.get_sandbox("sb-nope") is None


def test_branches_are_stored_together_and_usage_sums_by_tenant(tmp_path: Path) -> None:
    """A fork's rows go in one transaction (a clash in one leaves none of them); admission's
    sums per tenant match the rows themselves, with only the states asked for counted."""
    store = Store(tmp_path / "x.db")
    store.insert_sandboxes(
        [
            sandbox("sb-a", "t1", S.running),
            sandbox("sb-b", "t1", S.creating, vcpus=2, memory_mib=1024),
            sandbox("sb-c", "t2", S.running, memory_mib=128),
            sandbox("sb-d", "t2", S.stopped),
        ]
    )
    clash = [sandbox("sb-e", "t1", S.running), sandbox("sb-a", "t1", S.running)]
    with pytest.raises(sqlite3.IntegrityError):
        store.insert_sandboxes(clash)
    assert store.get_sandbox("sb-e") is None  # the whole batch was rolled back
    usage = store.usage_by_tenant(["creating", "running"])
    assert usage == {"t1": (2, 3, 1536), "t2": (1, 1, 128)}
    rows = store.list_sandboxes(None, ["creating", "running"])
    assert sum(u[2] for u in usage.values()) == sum(r.memory_mib for r in rows)
    assert store.usage_by_tenant(["paused"]) == {}


def test_snapshot_users_count_live_dependants_only(tmp_path: Path) -> None:
    store = Store(tmp_path / "x.db")
    store.insert_snapshot(snapshot("snap-1"))
    store.insert_snapshot(snapshot("snap-2", parent_snapshot_id="snap-1"))
    store.insert_sandbox(sandbox("sb-f", "t", S.running, base_snapshot_id="snap-1"))
    store.insert_sandbox(sandbox("sb-g", "t", S.deleted, base_snapshot_id="snap-1"))
    assert store.snapshot_users("snap-1") == (["sb-f"], ["snap-2"])
    store.update_snapshot("snap-2", state="deleted")
    store.update_sandbox("sb-f", state="deleted")
    assert store.snapshot_users("snap-1") == ([], [])
