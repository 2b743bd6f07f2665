"""What a task is and what running it produced."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, Field, ValidationError

from cella import errors
from cella.models.checkpoints import FileChange
from cella.models.evals import Step

__all__ = ["Step", "Task", "TaskResult", "load_tasks"]

TASK_ID = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"


class Task(BaseModel):
    """One sample. In its own sandbox forked from the snapshot: `setup` commands (must
    succeed), then the agent's part (`files` written, `patch` applied, `commands` run; these
    may fail), then `check`, whose exit status is the score (0: 1.0, else 0.0)."""

    model_config = {"extra": "forbid"}

    id: str = Field(pattern=TASK_ID)
    setup: list[str] = Field(default_factory=list)
    files: dict[str, str] = Field(default_factory=dict, description="guest path -> content")
    patch: str | None = Field(default=None, description="unified diff, applied in workdir")
    commands: list[str] = Field(default_factory=list)
    check: str
    workdir: str = "/workspace"
    timeout: float = Field(default=600, gt=0, description="seconds per command")
    artifacts: list[str] = Field(default_factory=list, description="guest files to keep")


class TaskResult(BaseModel):
    task_id: str
    snapshot_id: str
    sandbox_id: str | None = None
    score: float = 0.0
    passed: bool = False
    error: str | None = Field(default=None, description="why the task could not be run")
    error_code: str | None = Field(default=None, description="the error's code (cella.errors)")
    node: str | None = Field(default=None, description="the fleet node that ran it")
    duration_ms: float = 0.0
    steps: list[Step] = Field(default_factory=list)
    trace: str | None = Field(default=None, description="the sandbox's events (JSON Lines)")
    artifacts: dict[str, str] = Field(default_factory=dict, description="guest -> local path")
    changes: list[FileChange] = Field(
        default_factory=list,
        description="paths the task changed, against the snapshot it started from",
    )
    patch: str | None = Field(default=None, description="its text changes (local path)")
    diff_error: str | None = Field(default=None, description="why there are no changes")


def load_tasks(path: Path) -> list[Task]:
    """Tasks from a JSON Lines file (blank lines and `#` comments skipped)."""
    tasks = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            tasks.append(Task.model_validate(json.loads(line)))
        except (ValueError, ValidationError) as exc:
            raise errors.InvalidArgument(f"{path}:{number}: {exc}") from None
    ids = [t.id for t in tasks]
    if len(ids) != len(set(ids)):
        raise errors.InvalidArgument(f"{path}: task ids must be unique")
    return tasks
