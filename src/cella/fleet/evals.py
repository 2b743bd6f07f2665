"""Evals across a fleet: every task a Ray task on a node that runs sandboxes, forking the
snapshot on its own node through the gateway (`X-Cella-Node`; the snapshot is shipped there
once). A task whose node dies is run again elsewhere by Ray: its worker dies with the node
(a system failure, retried), or it sees its sandbox lost and says so (`Interrupted`,
retried). Results, traces and artifacts come back to the caller and land in one directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from cella.config import DaemonSettings
from cella.eval.runner import EvalJob, recorded
from cella.eval.tasks import Task, TaskResult
from cella.fleet import cluster
from cella.fleet.node_actor import RESOURCE, node_name
from cella.sdk import AsyncClient, Client
from cella.sdk._base import resolve

RETRIED = {"sandbox_lost", "node_unavailable"}
ATTEMPTS = 4


class Interrupted(Exception):
    """The task's sandbox or node went away mid-task: worth running again elsewhere."""


@ray.remote(  # type: ignore[call-overload,untyped-decorator]
    num_cpus=0,
    resources={RESOURCE: 0.001},
    max_retries=ATTEMPTS - 1,
    retry_exceptions=[Interrupted],
)
def _run_remote(task: dict[str, Any], snapshot_id: str, url: str, key: str) -> dict[str, Any]:
    from cella.eval.runner import run_task

    context = ray.get_runtime_context()
    labels = {k: v if isinstance(v, str) else v[0] for k, v in context.get_node_labels().items()}
    here = node_name(context.get_node_id(), labels)
    with tempfile.TemporaryDirectory(prefix="cella-eval-") as tmp:

        async def go() -> TaskResult:
            async with AsyncClient(url, key, headers={"X-Cella-Node": here}) as client:
                return await run_task(client, Task.model_validate(task), snapshot_id, Path(tmp))

        result = asyncio.run(go())
        if result.error_code in RETRIED:
            raise Interrupted(f"task {result.task_id} on {here}: {result.error}")
        result.node = here
        root = Path(tmp)
        files = {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}
    return {"result": result.model_dump(mode="json"), "files": files, "tmp": tmp}


def _land(answer: dict[str, Any], out_dir: Path) -> TaskResult:
    """A task's files written under `out_dir`, and its result pointing at them."""
    result = TaskResult.model_validate(answer["result"])
    for relative, data in answer["files"].items():
        target = out_dir / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    moved = {answer["tmp"]: str(out_dir)}

    def local(path: str) -> str:
        for old, new in moved.items():
            if path.startswith(old):
                return new + path[len(old) :]
        return path

    result.trace = local(result.trace) if result.trace else None
    result.artifacts = {k: local(v) for k, v in result.artifacts.items()}
    (out_dir / result.task_id / "result.json").write_text(result.model_dump_json(indent=2) + "\n")
    return result


@dataclass(frozen=True, slots=True)
class RayRunner:
    """An eval `Runner`: every task a Ray task on a node of the cluster at `address` (or
    `auto`), at most `parallel` at once; results in task order. The run is recorded by the
    gateway as results come in (the web console's eval page)."""

    address: str

    def __call__(self, job: EvalJob) -> list[TaskResult]:
        url, api_key = resolve(job.url, job.api_key)
        joined = cluster.connect(self.address, DaemonSettings().ray_allow_unauthenticated)
        job.out_dir.mkdir(parents=True, exist_ok=True)
        with Client(url, api_key) as gateway, _leaving(joined):
            name = job.name or job.out_dir.name
            run = gateway.create_eval_run(job.snapshot_id, len(job.tasks), name=name)
            (job.out_dir / "run.json").write_text(run.model_dump_json(indent=2) + "\n")

            def done(result: TaskResult) -> None:
                gateway.record_eval_result(run.id, recorded(result))
                if job.on_done is not None:
                    job.on_done(result)

            try:
                return _run_all(job, url, api_key, done)
            finally:
                gateway.finish_eval_run(run.id)


@contextlib.contextmanager
def _leaving(joined: bool) -> Iterator[None]:
    """Leaves the cluster afterwards if this run joined it (no Ray threads left printing)."""
    try:
        yield
    finally:
        if joined:
            ray.shutdown()


def _run_all(
    job: EvalJob, url: str, api_key: str, on_done: Callable[[TaskResult], None]
) -> list[TaskResult]:
    tasks, snapshot_id, out_dir = job.tasks, job.snapshot_id, job.out_dir
    todo = list(tasks)
    running: dict[Any, Task] = {}
    done: dict[str, TaskResult] = {}
    while todo or running:
        while todo and len(running) < job.parallel:
            task = todo.pop(0)
            ref = _run_remote.options(scheduling_strategy="SPREAD").remote(
                task.model_dump(mode="json"), snapshot_id, url, api_key
            )
            running[ref] = task
        [ready], _ = ray.wait(list(running), num_returns=1)
        task = running.pop(ready)
        try:
            result = _land(ray.get(ready), out_dir)
        except Exception as exc:  # retries used up: the task reports why
            cause = exc.cause if isinstance(exc, ray.exceptions.RayTaskError) else exc
            result = TaskResult(
                task_id=task.id, snapshot_id=snapshot_id, error=f"{type(cause).__name__}: {cause}"
            )
        done[task.id] = result
        on_done(result)
    results = [done[t.id] for t in tasks]
    (out_dir / "results.jsonl").write_text("".join(r.model_dump_json() + "\n" for r in results))
    return results
