"""`cella snapshot ...`: list, fork from and delete snapshots."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from cella.cli._output import console, emit_json, out
from cella.cli.sandbox import _show
from cella.sdk import Client

app = typer.Typer(help="Snapshots of sandboxes (disk and memory).", no_args_is_help=True)
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]


@app.command("ls")
def list_(json_: JsonOpt = False) -> None:
    """List snapshots."""
    with Client() as client:
        snaps = client.snapshots()
    if json_:
        emit_json([s.info.model_dump(mode="json") for s in snaps])
        return
    table = Table("id", "name", "state", "from sandbox", "size", "paused", "created")
    for s in snaps:
        i = s.info
        size = f"{(i.size_bytes or 0) >> 20} MiB"
        table.add_row(
            i.id,
            i.name,
            i.state.value,
            i.sandbox_id,
            size,
            f"{i.paused_ms} ms",
            i.created_at.strftime("%Y-%m-%d %H:%M:%S"),
        )
    out.print(table)


@app.command()
def fork(
    snapshot_id: str,
    count: Annotated[int, typer.Option("-n", "--count", help="how many sandboxes")] = 1,
    json_: JsonOpt = False,
) -> None:
    """New sandboxes restored from a snapshot."""
    with Client() as client:
        sandboxes = client.get_snapshot(snapshot_id).fork(count)
    _show(sandboxes, json_)


@app.command()
def rm(snapshot_id: str) -> None:
    """Delete a snapshot (refused while sandboxes or snapshots are built on it)."""
    with Client() as client:
        client.get_snapshot(snapshot_id).delete()
    console.print(f"deleted {snapshot_id}")
