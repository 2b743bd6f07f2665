"""Eval runs: recorded by `cella eval run`, read by people (the web console) and tools."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query

from cella import errors
from cella.models.evals import TASK_ID, EvalResult, EvalRun, EvalRunCreate, EvalRunList
from cella.server.deps import Auth, FrontDep
from cella.service.keys import require_admin

router = APIRouter(prefix="/v1/evals", tags=["evals"])


@router.post("", status_code=201, response_model=EvalRun)
async def create_run(body: EvalRunCreate, svc: FrontDep, who: Auth) -> EvalRun:
    """Starts recording an eval run over forks of `snapshot_id` (an id, name or name:tag)."""
    snapshot_id = await svc.snapshot_id(who, body.snapshot_id)
    return svc.evals.create(who.tenant, body, snapshot_id)


@router.get("", response_model=EvalRunList)
async def list_runs(
    svc: FrontDep,
    who: Auth,
    all_tenants: Annotated[bool, Query(description="every tenant's (admin keys)")] = False,
) -> EvalRunList:
    """The newest runs with their pass/fail counts (results: `GET /v1/evals/{id}`)."""
    if all_tenants:
        require_admin(who, "list every tenant's eval runs")
    return EvalRunList(runs=svc.evals.runs(None if all_tenants else who.tenant))


@router.get("/{run_id}", response_model=EvalRun)
async def get_run(run_id: str, svc: FrontDep, who: Auth) -> EvalRun:
    """A run with every recorded result (an admin key reads any tenant's)."""
    return svc.evals.get(None if who.admin else who.tenant, run_id)


@router.put("/{run_id}/results/{task_id}", response_model=EvalResult)
async def record_result(
    run_id: str,
    task_id: Annotated[str, Path(pattern=TASK_ID)],
    body: EvalResult,
    svc: FrontDep,
    who: Auth,
) -> EvalResult:
    """Records (or replaces) one task's result; the body's `task_id` must match."""
    if body.task_id != task_id:
        raise errors.InvalidArgument(f"task_id {body.task_id!r} in a request for {task_id!r}")
    return svc.evals.record(who.tenant, run_id, body)


@router.post("/{run_id}/finish", response_model=EvalRun)
async def finish_run(run_id: str, svc: FrontDep, who: Auth) -> EvalRun:
    """The run has ended: no more results are taken."""
    return svc.evals.finish(who.tenant, run_id)


@router.delete("/{run_id}", status_code=204)
async def delete_run(run_id: str, svc: FrontDep, who: Auth) -> None:
    svc.evals.delete(who.tenant, run_id)
