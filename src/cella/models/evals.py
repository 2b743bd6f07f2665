"""Eval runs as the daemon keeps them: what `cella eval run` recorded, task by task."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, Field

TASK_ID = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"


class Step(BaseModel):
    model_config = {"allow_inf_nan": False}

    phase: str
    command: str
    exit_code: int | None
    timed_out: bool = False
    duration_ms: float
    stdout: str = Field(description="the last 4 KiB")
    stderr: str = Field(description="the last 4 KiB")


class EvalRunCreate(BaseModel):
    model_config = {"extra": "forbid"}

    snapshot_id: str = Field(min_length=1, max_length=200)
    tasks: int = Field(ge=0, le=1_000_000, description="how many tasks the run has")
    name: str | None = Field(default=None, max_length=200)


class EvalResult(BaseModel):
    """One task's outcome; its trace stays readable by `sandbox_id`."""

    model_config = {"allow_inf_nan": False}

    task_id: str = Field(pattern=TASK_ID)
    sandbox_id: str | None = None
    passed: bool = False
    score: float = 0.0
    duration_ms: float = Field(default=0.0, ge=0)
    error: str | None = Field(default=None, max_length=4096)
    error_code: str | None = Field(default=None, max_length=100)
    node: str | None = Field(default=None, max_length=200)
    steps: list[Step] = Field(default_factory=list, max_length=1000)


class EvalRun(BaseModel):
    id: str
    tenant: str | None = Field(default=None, description="whose it is")
    name: str | None = None
    snapshot_id: str
    tasks: int
    created_at: datetime
    finished_at: datetime | None = None
    passed: int = 0
    failed: int = Field(default=0, description="tasks that ran and did not pass")
    errors: int = Field(default=0, description="tasks that could not be run")
    results: list[EvalResult] = Field(
        default_factory=list, description="in the order recorded (empty in listings)"
    )


class EvalRunList(BaseModel):
    runs: list[EvalRun]
