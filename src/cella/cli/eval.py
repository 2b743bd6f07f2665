"""`cella eval run`: tasks in fresh forks of a snapshot, with a progress bar and a summary."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from cella.cli._output import Listing, console, emit_json, out

app = typer.Typer(
    help="Run evaluation tasks across a fleet of sandboxes.",
    no_args_is_help=True,
    rich_markup_mode="markdown",
)


@app.command()
def run(
    tasks_file: Annotated[Path, typer.Argument(help="tasks, one JSON object a line")],
    snapshot: Annotated[str, typer.Option(help="the prepared snapshot every task forks")],
    parallel: Annotated[int, typer.Option(min=1, max=256, help="tasks at once")] = 4,
    out_dir: Annotated[Path, typer.Option("--out", help="results, traces and artifacts")] = Path(
        "eval-results"
    ),
    only: Annotated[list[str] | None, typer.Option(help="run just these task ids")] = None,
    ray: Annotated[
        str | None,
        typer.Option(help="run tasks as Ray tasks on this cluster's nodes (or `auto`)"),
    ] = None,
    name: Annotated[
        str | None, typer.Option(help="the run's name in the web console (default: --out's)")
    ] = None,
    json_: Annotated[bool, typer.Option("--json", help="print results as JSON")] = False,
) -> None:
    """Run each task in its own sandbox forked from SNAPSHOT; the check's exit is the score."""
    from cella.eval import Runner, TaskResult, load_tasks, run_eval, summarize

    runner: Runner | None = None
    if ray is not None:  # Ray is the `cella[ray]` extra: imported only when asked for
        from cella.fleet.evals import RayRunner

        runner = RayRunner(ray)
    tasks = load_tasks(tasks_file)
    if only:
        unknown = set(only) - {t.id for t in tasks}
        if unknown:
            raise typer.BadParameter(f"no such tasks: {', '.join(sorted(unknown))}")
        tasks = [t for t in tasks if t.id in only]
    with Progress(
        TextColumn("[bold]eval[/bold]"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[last]}"),
        TimeElapsedColumn(),
        console=console,
        disable=json_,
    ) as bar:
        job = bar.add_task("tasks", total=len(tasks), last="")

        def done(r: TaskResult) -> None:
            bar.update(job, advance=1, last=f"{r.task_id}: {'pass' if r.passed else 'FAIL'}")

        # with --json, stdout carries the JSON only (Ray's messages go to stderr)
        quiet = contextlib.redirect_stdout(sys.stderr) if json_ else contextlib.nullcontext()
        with quiet:
            results = run_eval(
                tasks,
                snapshot,
                parallel=parallel,
                out_dir=out_dir,
                on_done=done,
                runner=runner,
                name=name,
            )
    summary = summarize(results)
    if json_:
        emit_json({"summary": summary, "results": [r.model_dump(mode="json") for r in results]})
        return
    table = Listing(
        "task",
        "score",
        "check exit",
        "sandbox",
        "ms",
        "error",
        ids=("task", "sandbox"),
        give_way={"error": 10},
    )
    for r in results:
        check = next((s for s in reversed(r.steps) if s.phase == "check"), None)
        table.add_row(
            escape(r.task_id),
            f"{r.score:g}",
            "" if check is None else str(check.exit_code),
            escape(r.sandbox_id or ""),
            f"{r.duration_ms:.0f}",
            escape(r.error or ""),
        )
    out.print(table)
    console.print(
        f"{summary['passed']}/{summary['tasks']} passed, mean score {summary['mean_score']}, "
        f"{summary['errors']} errors; results in {out_dir / 'results.jsonl'}"
    )
