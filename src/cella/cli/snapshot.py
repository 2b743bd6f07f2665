"""`cella snapshot ...`: list, fork from and delete snapshots."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Annotated

import typer
from rich.markup import escape

from cella.cli._output import Listing, console, emit_json, out
from cella.cli.sandbox import _show
from cella.models import Snapshot as SnapshotInfo
from cella.sdk import Client

app = typer.Typer(
    help="Snapshots of sandboxes (disk and memory).",
    no_args_is_help=True,
    rich_markup_mode="markdown",
)
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]


@app.command("ls")
def list_(json_: JsonOpt = False) -> None:
    """List snapshots."""
    with Client() as client:
        snaps = client.snapshots()
    if json_:
        emit_json([s.info.model_dump(mode="json") for s in snaps])
        return
    out.print(listing([s.info for s in snaps]))


def listing(infos: Sequence[SnapshotInfo]) -> Listing:
    """The `snapshot ls` table: whole ids (its own and its sandbox's)."""
    table = Listing(
        "id",
        "name",
        "state",
        "from sandbox",
        "size",
        "pause",
        "created",
        ids=("id", "from sandbox"),
        give_way={"name": 4, "created": 10},
    )
    for i in infos:
        table.add_row(
            escape(i.id),
            escape(i.name),
            i.state.value,
            escape(i.sandbox_id),
            "" if i.size_bytes is None else f"{i.size_bytes >> 20} MiB",
            "" if i.paused_ms is None else f"{i.paused_ms:.0f} ms",
            i.created_at.strftime("%Y-%m-%d %H:%M:%S"),
        )
    return table


@app.command("from-image")
def from_image(
    name: str,
    image: str,
    tag: Annotated[str | None, typer.Option(help="tag within NAME (default: the image's)")] = None,
    registry: Annotated[
        str | None, typer.Option(help="pull with this registry's credentials (`cella registry`)")
    ] = None,
    disk_mib: Annotated[int | None, typer.Option(help="file system size in MiB")] = None,
    wait: Annotated[bool, typer.Option(help="wait until it is ready or failed")] = True,
    json_: JsonOpt = False,
) -> None:
    """A snapshot from a registry image, yours alone (built, booted once, snapshotted)."""
    with Client() as client:
        snap = client.snapshot_from_image(
            name, image, tag=tag, disk_mib=disk_mib, registry=registry
        )
        while wait and snap.info.state == "creating":
            time.sleep(2)
            snap = client.get_snapshot(snap.id)
    if json_:
        emit_json(snap.info.model_dump(mode="json"))
    elif snap.info.state == "error":
        console.print(f"[red]{snap.id} failed:[/red] {escape(snap.info.error or '')}")
        raise typer.Exit(1)
    else:
        console.print(f"{snap.id} {snap.info.state}")


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
