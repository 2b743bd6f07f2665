"""`cella backup DEST` (the daemon writes it, online) and `cella restore SRC` (into a data
directory no daemon runs on)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from cella.cli._output import console, emit_json

JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]


@contextmanager
def _progress(quiet: bool) -> Iterator[Callable[[str, int, int], None]]:
    """A bar per step on a terminal (stderr); nothing with --json."""
    if quiet:
        yield lambda _step, _done, _total: None
        return
    bars: dict[str, Any] = {}
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    with Progress(*columns, TimeElapsedColumn(), console=console, transient=False) as shown:

        def update(step: str, done: int, total: int) -> None:
            if step not in bars:
                bars[step] = shown.add_task(step, total=max(total, 1))
            shown.update(bars[step], completed=done if total else 1, total=max(total, 1))

        yield update


def backup(
    dest: Annotated[Path, typer.Argument(help="a new or empty directory on the daemon's host")],
    with_secrets_key: Annotated[
        bool,
        typer.Option(
            "--with-secrets-key",
            help="Include the sealed secrets' key (else keep it apart: the restore needs it).",
        ),
    ] = False,
    json_: JsonOpt = False,
) -> None:
    """Back up the daemon's data directory while it runs: its databases (SQLite's backup
    API), keys, snapshots, every sandbox's disk (a running one paused for the copy) and
    volumes, with a manifest of checksums. Against a fleet gateway: the gateway's own
    databases and keys (its nodes are backed up each on its own)."""
    from cella.sdk import Client

    with Client() as client, _progress(json_) as progress:
        report = client.backup(
            str(dest.absolute()), with_secrets_key=with_secrets_key, on_progress=progress
        )
    if json_:
        emit_json(report)
        return
    for warning in report["warnings"]:
        console.print(f"[yellow]warning[/yellow] {warning}", highlight=False)
    what = (
        "the fleet gateway (its sandboxes and snapshots are on its nodes: back those up there)"
        if report.get("kind") == "gateway"
        else f"{len(report['sandboxes'])} sandbox(es), {len(report['snapshots'])} snapshot(s)"
    )
    console.print(
        f"backed up {what}: {report['files']} files, {report['bytes'] >> 20} MiB in "
        f"{report['dest']}",
        highlight=False,
    )
    if report["secrets_key"] == "excluded" and report["sealed_values"]:
        console.print(
            "[yellow]the secrets key is not in the backup[/yellow]: keep the daemon's "
            "secrets.key apart; `cella restore` needs it (--secrets-key-file)",
            highlight=False,
        )


def restore(
    src: Annotated[Path, typer.Argument(help="a backup made by `cella backup`")],
    data_dir: Annotated[
        Path | None,
        typer.Option(help="the data directory to restore into (default: the daemon's)"),
    ] = None,
    secrets_key_file: Annotated[
        Path | None,
        typer.Option(help="the secrets key the backup's sealed secrets were sealed with"),
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Replace what a non-empty data directory holds.")
    ] = False,
    json_: JsonOpt = False,
) -> None:
    """Restore a backup into a fresh data directory (no daemon running on it); then start
    `cella serve` there: its sandboxes are stopped ones, resumed on request, and its
    snapshots fork."""
    from cella.config import DaemonSettings
    from cella.service.restore import restore as run

    target = data_dir or DaemonSettings().data_dir
    with _progress(json_) as progress:
        report = run(
            src, target, secrets_key_file=secrets_key_file, force=force, progress=progress
        ).to_json()
    if json_:
        emit_json(report)
        return
    gateway = report["kind"] == "gateway"
    what = (
        "a fleet gateway"
        if gateway
        else f"{len(report['sandboxes'])} sandbox(es) and {len(report['snapshots'])} snapshot(s)"
    )
    serve = "cella serve --ray ADDRESS" if gateway else "cella serve"
    console.print(
        f"restored {what} of cella {report['version']} into {report['data_dir']} (secrets "
        f"key: {report['secrets_key']}); start `{serve} --data-dir {report['data_dir']}`",
        highlight=False,
    )
