"""`cella sandbox checkpoint|checkpoints|diff|rewind`: checkpoints of a sandbox, the file
changes between them, and going back to one (commands of `cella sandbox`)."""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from rich.markup import escape

from cella.cli._output import Listing, console, emit_json, out
from cella.cli.sandbox import JsonOpt, app
from cella.models.checkpoints import NOW
from cella.sdk import Client

SIGN = {"added": "[green]+[/green]", "removed": "[red]-[/red]", "modified": "[yellow]~[/yellow]"}


@app.command()
def checkpoint(
    sandbox_id: str,
    name: Annotated[str | None, typer.Argument(help="default: cp-<n>")] = None,
    json_: JsonOpt = False,
) -> None:
    """Take a checkpoint of a running sandbox (disk and memory), kept with it."""
    with Client() as client:
        cp = client.get(sandbox_id).checkpoint(name)
    if json_:
        emit_json(cp.model_dump(mode="json"))
    else:
        console.print(f"checkpoint {escape(cp.name)} ({cp.id}), paused {cp.paused_ms} ms")
        out.print(cp.name)


@app.command()
def checkpoints(sandbox_id: str, json_: JsonOpt = False) -> None:
    """A sandbox's checkpoints, oldest first."""
    with Client() as client:
        rows = client.get(sandbox_id).checkpoints()
    if json_:
        emit_json([c.model_dump(mode="json") for c in rows])
        return
    table = Listing("name", "id", "created", "paused ms", "size", ids=("name", "id"))
    for c in rows:
        size = f"{(c.size_bytes or 0) >> 20} MiB"
        table.add_row(escape(c.name), c.id, str(c.created_at), str(c.paused_ms), size)
    out.print(table)


@app.command()
def diff(
    sandbox_id: str,
    a: Annotated[str, typer.Argument(help="the checkpoint it starts from")],
    b: Annotated[str, typer.Argument(help="the checkpoint it goes to (`now`: as it is)")] = NOW,
    path: Annotated[str, typer.Option(help="only changes under this directory")] = "/",
    patch: Annotated[
        bool, typer.Option("--patch", help="print a patch `git apply` takes in PATH")
    ] = False,
    json_: JsonOpt = False,
) -> None:
    """What changed in the sandbox's files from checkpoint A to B (or to now)."""
    with Client() as client:
        result = client.get(sandbox_id).diff(a, b)
    if patch:
        sys.stdout.write(result.patch(path))
        return
    changes = result.under(path)
    if json_:
        emit_json({**result.model_dump(mode="json"), "changes": [c.model_dump() for c in changes]})
        return
    for c in changes:
        size = c.size if c.size is not None else c.old_size
        note = " (binary)" if c.binary else " (too large to diff)" if c.too_large else ""
        changed = c.old_mode and c.mode and c.old_mode != c.mode
        mode = f" {c.old_mode:o}→{c.mode:o}" if changed else ""
        out.print(f"{SIGN[c.change]} {escape(c.path)}  {c.kind} {size} B{mode}{note}")
    if result.truncated:
        console.print("[yellow]more paths changed than are listed[/yellow]")


@app.command()
def rewind(sandbox_id: str, checkpoint: str, json_: JsonOpt = False) -> None:
    """Take a sandbox back to a checkpoint in place: its files and memory as they were."""
    with Client() as client:
        sb = client.get(sandbox_id).rewind(checkpoint)
    if json_:
        emit_json(sb.info.model_dump(mode="json"))
    else:
        console.print(f"{sb.id} rewound to {escape(checkpoint)}")
        out.print(sb.id)
