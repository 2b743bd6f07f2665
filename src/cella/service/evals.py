"""Eval runs: what `cella eval run` recorded, kept so a regression is a look away.

The runner creates a run, records each task's result as it ends (by task id: recording
again replaces) and finishes the run. The tasks' traces are the sandboxes' own events,
kept after the sandboxes are deleted; lineage shows the scores of the sandboxes that ran
a task.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable

from cella import errors
from cella.models.evals import EvalResult, EvalRun, EvalRunCreate
from cella.store import EvalRunRecord, Store
from cella.store.db import now

MAX_RESULT_BYTES = 1 << 20
LIST_LIMIT = 200


class Evals:
    """`sandbox_tenant(id)` says whose a sandbox is (None: unknown): a result names only
    a sandbox of the run's tenant."""

    def __init__(self, store: Store, sandbox_tenant: Callable[[str], str | None]) -> None:
        self.store = store
        self.sandbox_tenant = sandbox_tenant

    def create(self, tenant: str, body: EvalRunCreate, snapshot_id: str) -> EvalRun:
        """A run over forks of `snapshot_id`: the caller's snapshot (`body.snapshot_id`)
        resolved by whoever holds snapshots (a daemon, or a fleet's nodes)."""
        run = EvalRunRecord(
            id=f"ev-{secrets.token_hex(6)}",
            tenant=tenant,
            name=body.name,
            snapshot_id=snapshot_id,
            tasks=body.tasks,
            created_at=now(),
        )
        self.store.add_eval_run(run)
        return self._view(run)

    def record(self, tenant: str, run_id: str, result: EvalResult) -> EvalResult:
        run = self._owned(tenant, run_id)
        if run.finished_at is not None:
            raise errors.InvalidState(f"eval run {run_id} is finished")
        if result.sandbox_id is not None and self.sandbox_tenant(result.sandbox_id) != tenant:
            raise errors.NotFound(f"no sandbox {result.sandbox_id!r}")
        text = result.model_dump_json()
        if len(text) > MAX_RESULT_BYTES:
            raise errors.PayloadTooLarge(f"a result of {len(text)} bytes; at most 1 MiB")
        self.store.put_eval_result(
            run.id, result.task_id, result.sandbox_id, result.passed, result.error, text
        )
        return result

    def finish(self, tenant: str, run_id: str) -> EvalRun:
        run = self._owned(tenant, run_id)
        if run.finished_at is None:
            self.store.finish_eval_run(run.id)
        return self.get(tenant, run_id)

    def get(self, tenant: str | None, run_id: str) -> EvalRun:
        """A run with its results (`tenant` None: anyone's, for admin keys)."""
        run = self._owned(tenant, run_id)
        results = [EvalResult.model_validate_json(t) for t in self.store.eval_results(run.id)]
        return self._view(run, results)

    def runs(self, tenant: str | None) -> list[EvalRun]:
        """The newest runs, with their counts but not their results."""
        return [self._view(run) for run in self.store.eval_runs(tenant, LIST_LIMIT)]

    def delete(self, tenant: str, run_id: str) -> None:
        self.store.delete_eval_run(self._owned(tenant, run_id).id)

    def _owned(self, tenant: str | None, run_id: str) -> EvalRunRecord:
        run = self.store.eval_run(run_id)
        if run is None or (tenant is not None and run.tenant != tenant):
            raise errors.NotFound(f"no eval run {run_id!r}")
        return run

    def _view(self, run: EvalRunRecord, results: list[EvalResult] | None = None) -> EvalRun:
        passed, failed, failures = self.store.eval_counts(run.id)
        return EvalRun.model_validate(
            {
                "id": run.id,
                "tenant": run.tenant,
                "name": run.name,
                "snapshot_id": run.snapshot_id,
                "tasks": run.tasks,
                "created_at": run.created_at,
                "finished_at": run.finished_at,
                "passed": passed,
                "failed": failed,
                "errors": failures,
                "results": results or [],
            }
        )
