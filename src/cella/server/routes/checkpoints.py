"""Checkpoints of a sandbox, the file changes between them, and rewinding to one."""

from __future__ import annotations

import dataclasses

from fastapi import APIRouter

from cella.models import Sandbox
from cella.models.checkpoints import (
    NOW,
    Checkpoint,
    CheckpointCreate,
    CheckpointDiff,
    CheckpointList,
    FileChange,
    RewindRequest,
)
from cella.server.deps import Auth, DaemonDep
from cella.store import SnapshotRecord

router = APIRouter(prefix="/v1/sandboxes", tags=["checkpoints"])


def _checkpoint(snap: SnapshotRecord) -> Checkpoint:
    return Checkpoint(
        id=snap.id,
        name=snap.checkpoint or snap.name,
        sandbox_id=snap.sandbox_id,
        size_bytes=snap.size_bytes,
        paused_ms=snap.paused_ms,
        created_at=snap.created_at,  # type: ignore[arg-type]
    )


@router.post("/{sandbox_id}/checkpoints", status_code=201, response_model=Checkpoint)
async def create_checkpoint(
    sandbox_id: str, body: CheckpointCreate, svc: DaemonDep, who: Auth
) -> Checkpoint:
    """Saves the running sandbox's disk and memory as a checkpoint kept with it (of a
    restored sandbox, only what it changed since)."""
    return _checkpoint(await svc.checkpoints.checkpoint(who, sandbox_id, body.name))


@router.get("/{sandbox_id}/checkpoints", response_model=CheckpointList)
async def list_checkpoints(sandbox_id: str, svc: DaemonDep, who: Auth) -> CheckpointList:
    """The sandbox's checkpoints, oldest first."""
    rows = svc.checkpoints.find(who, sandbox_id)
    return CheckpointList(checkpoints=[_checkpoint(r) for r in rows])


@router.get("/{sandbox_id}/diff", response_model=CheckpointDiff)
async def diff_checkpoints(
    sandbox_id: str, a: str, svc: DaemonDep, who: Auth, b: str = NOW
) -> CheckpointDiff:
    """Paths added, removed and modified from checkpoint `a` to checkpoint `b` (`now`: the
    sandbox as it is), with sizes, modes and unified diffs of text files up to a bound."""
    changes, truncated = await svc.checkpoints.diff(who, sandbox_id, a, b)
    return CheckpointDiff(
        sandbox_id=sandbox_id,
        a=a,
        b=b,
        changes=[FileChange.model_validate(dataclasses.asdict(c)) for c in changes],
        truncated=truncated,
    )


@router.post("/{sandbox_id}/rewind", response_model=Sandbox)
async def rewind_sandbox(
    sandbox_id: str, body: RewindRequest, svc: DaemonDep, who: Auth
) -> Sandbox:
    """The sandbox goes back to the checkpoint in place: same id, its files and memory as
    they were then (a process's state too); every checkpoint is kept."""
    return Sandbox.model_validate(await svc.checkpoints.rewind(who, sandbox_id, body.checkpoint))
