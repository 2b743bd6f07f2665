"""Runs tasks concurrently, each in a fresh sandbox forked from the same snapshot.

Per task, `out/<task id>/` keeps the trace (`trace.jsonl`), the artifacts and the result
(`result.json`); `out/results.jsonl` has every result in task order. Running a task again
from the same snapshot starts from the same disk and memory, so it reproduces.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cella import errors
from cella.eval.tasks import Step, Task, TaskResult
from cella.models.evals import EvalResult
from cella.sdk import AsyncClient, AsyncSandbox

TAIL = 4096
PATCH_PATH = "/tmp/cella-task.patch"


async def _step(sb: AsyncSandbox, task: Task, phase: str, command: str) -> Step:
    start = time.monotonic()
    r = await sb.exec(command, cwd=task.workdir, timeout=task.timeout)
    return Step(
        phase=phase,
        command=command,
        exit_code=r.exit_code,
        timed_out=r.timed_out,
        duration_ms=round((time.monotonic() - start) * 1000, 1),
        stdout=r.stdout[-TAIL:].decode(errors="replace"),
        stderr=r.stderr[-TAIL:].decode(errors="replace"),
    )


async def _play(sb: AsyncSandbox, task: Task, result: TaskResult) -> None:
    await sb.files.mkdir(task.workdir, parents=True)
    for command in task.setup:
        step = await _step(sb, task, "setup", command)
        result.steps.append(step)
        if step.exit_code != 0:
            raise errors.CommandFailed(f"setup failed ({step.exit_code}): {command}")
    for path, content in task.files.items():
        target = path if path.startswith("/") else f"{task.workdir}/{path}"
        await sb.files.write(target, content, parents=True)
    if task.patch is not None:
        await sb.files.write(PATCH_PATH, task.patch)
        apply = f"git apply --whitespace=nowarn {PATCH_PATH} || patch -p1 < {PATCH_PATH}"
        result.steps.append(await _step(sb, task, "patch", apply))
    for command in task.commands:
        result.steps.append(await _step(sb, task, "agent", command))
    check = await _step(sb, task, "check", task.check)
    result.steps.append(check)
    result.passed = check.exit_code == 0
    result.score = 1.0 if result.passed else 0.0


async def _keep(sb: AsyncSandbox, task: Task, where: Path, result: TaskResult) -> None:
    for path in task.artifacts:
        local = where / "artifacts" / path.lstrip("/")
        try:
            data = await sb.files.read(path)
        except errors.CellaError as exc:
            result.artifacts[path] = f"(not kept: {exc.message})"
            continue
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_bytes(data)
        result.artifacts[path] = str(local)


async def _start_point(sb: AsyncSandbox, result: TaskResult) -> str | None:
    """A checkpoint of the fork as it starts (the snapshot's state), to diff against."""
    try:
        return (await sb.checkpoint("start")).name
    except errors.CellaError as exc:
        result.diff_error = exc.message
        return None


async def _changes(
    sb: AsyncSandbox, task: Task, start: str, where: Path, result: TaskResult
) -> None:
    """What the task changed: every path (without the text), and a patch of its workdir."""
    try:
        diff = await sb.diff(start)
    except errors.CellaError as exc:
        result.diff_error = exc.message
        return
    result.changes = [c.model_copy(update={"diff": None}) for c in diff.changes]
    patch = where / "changes.patch"
    patch.write_text(diff.patch(task.workdir))
    result.patch = str(patch)


async def run_task(client: AsyncClient, task: Task, snapshot_id: str, out_dir: Path) -> TaskResult:
    """One task in its own fork of the snapshot; the sandbox is deleted afterwards."""
    where = out_dir / task.id
    where.mkdir(parents=True, exist_ok=True)
    result = TaskResult(task_id=task.id, snapshot_id=snapshot_id)
    start = time.monotonic()
    sb: AsyncSandbox | None = None
    try:
        snapshot = await client.get_snapshot(snapshot_id)
        sb = (await snapshot.fork(1))[0]
        result.sandbox_id = sb.id
        start_point = await _start_point(sb, result)
        await _play(sb, task, result)
        await _keep(sb, task, where, result)
        if start_point is not None:
            await _changes(sb, task, start_point, where, result)
    except errors.CellaError as exc:
        result.error, result.error_code = exc.message, exc.code
    finally:
        if sb is not None:
            try:
                await sb.delete()
            except errors.CellaError as exc:  # said in the result, never lost with it
                result.error = result.error or f"delete failed: {exc.message}"
                result.error_code = result.error_code or exc.code
            try:
                trace = where / "trace.jsonl"
                events = await client.events(sb.id)
                trace.write_text("".join(e.model_dump_json() + "\n" for e in events))
                result.trace = str(trace)
            except errors.CellaError as exc:
                result.error = result.error or f"trace not kept: {exc.message}"
                result.error_code = result.error_code or exc.code
    result.duration_ms = round((time.monotonic() - start) * 1000, 1)
    (where / "result.json").write_text(result.model_dump_json(indent=2) + "\n")
    return result


async def arun_eval(
    client: AsyncClient,
    tasks: list[Task],
    snapshot_id: str,
    *,
    parallel: int = 4,
    out_dir: Path,
    on_done: Callable[[TaskResult], None] | None = None,
    name: str | None = None,
) -> list[TaskResult]:
    """Runs every task, at most `parallel` at once; results in task order. The run is
    recorded on the daemon as it goes (`client.eval_run`, the web console's eval page);
    its id is in `out/run.json`."""
    if parallel < 1:
        raise errors.InvalidArgument("parallel must be at least 1")
    out_dir.mkdir(parents=True, exist_ok=True)
    run = await client.create_eval_run(snapshot_id, len(tasks), name=name or out_dir.name)
    (out_dir / "run.json").write_text(run.model_dump_json(indent=2) + "\n")
    gate = asyncio.Semaphore(parallel)

    async def one(task: Task) -> TaskResult:
        async with gate:
            result = await run_task(client, task, snapshot_id, out_dir)
        await client.record_eval_result(run.id, recorded(result))
        if on_done is not None:
            on_done(result)
        return result

    try:
        results = list(await asyncio.gather(*(one(t) for t in tasks)))
    finally:
        await client.finish_eval_run(run.id)
    (out_dir / "results.jsonl").write_text("".join(r.model_dump_json() + "\n" for r in results))
    return results


def recorded(result: TaskResult) -> EvalResult:
    """A task's result as the daemon keeps it (local paths of traces and artifacts stay
    in the output directory)."""
    local = {"snapshot_id", "trace", "artifacts", "changes", "patch", "diff_error"}
    return EvalResult.model_validate(result.model_dump(exclude=local))


@dataclass(frozen=True, slots=True)
class EvalJob:
    """An eval run as `run_eval` hands it to a `Runner`."""

    tasks: list[Task]
    snapshot_id: str
    parallel: int
    out_dir: Path
    url: str | None = None
    api_key: str | None = None
    on_done: Callable[[TaskResult], None] | None = None
    name: str | None = None


# Runs a job somewhere else than this process's event loop (e.g. as Ray tasks on a fleet's
# nodes: `cella.fleet.evals.RayRunner`), recording the run as `arun_eval` does; results in
# task order.
Runner = Callable[[EvalJob], list[TaskResult]]


def run_eval(
    tasks: list[Task],
    snapshot_id: str,
    *,
    parallel: int = 4,
    out_dir: Path,
    url: str | None = None,
    api_key: str | None = None,
    on_done: Callable[[TaskResult], None] | None = None,
    runner: Runner | None = None,
    name: str | None = None,
) -> list[TaskResult]:
    """The blocking form of `arun_eval` (a client is made from the environment). With a
    `runner`, the tasks run where it runs them (`cella.fleet.evals.RayRunner`: as Ray tasks
    across the fleet's nodes, talking to the fleet gateway at `url`)."""
    if runner is not None:
        return runner(EvalJob(tasks, snapshot_id, parallel, out_dir, url, api_key, on_done, name))

    async def go() -> list[TaskResult]:
        async with AsyncClient(url, api_key) as client:
            return await arun_eval(
                client,
                tasks,
                snapshot_id,
                parallel=parallel,
                out_dir=out_dir,
                on_done=on_done,
                name=name,
            )

    return asyncio.run(go())


def summarize(results: list[TaskResult]) -> dict[str, Any]:
    durations = [r.duration_ms for r in results] or [0.0]
    return {
        "tasks": len(results),
        "passed": sum(r.passed for r in results),
        "failed": sum(not r.passed and r.error is None for r in results),
        "errors": sum(r.error is not None for r in results),
        "mean_score": round(statistics.mean(r.score for r in results), 4) if results else 0.0,
        "duration_ms_p50": round(statistics.median(durations), 1),
        "duration_ms_max": round(max(durations), 1),
    }
