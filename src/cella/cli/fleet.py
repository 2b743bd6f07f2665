"""`cella fleet ...`: a fleet gateway's view of its Ray cluster (admin)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape

from cella.cli._output import Listing, console, emit_json, out
from cella.sdk import Client

app = typer.Typer(
    help="A fleet of node daemons on Ray (`cella serve --ray`).",
    no_args_is_help=True,
    rich_markup_mode="markdown",
)


@app.command()
def status(json_: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> None:
    """Every node: health, capacity committed and free, sandboxes, cached snapshots."""
    with Client() as client:
        fleet = client.fleet()
    if json_:
        emit_json(fleet.model_dump(mode="json"))
        return
    table = Listing(
        "node",
        "health",
        "sandboxes",
        "memory MiB used/all",
        "vCPUs used/all",
        "snapshots",
        "url",
        ids=("node",),
        give_way={"health": 12, "url": 12},
    )
    for node in fleet.nodes:
        cap = node.capacity
        table.add_row(
            escape(node.name),
            "[green]up[/green]" if node.healthy else f"[red]down[/red] {escape(node.reason or '')}",
            str(node.sandboxes),
            f"{cap.memory_mib_committed}/{cap.memory_mib}" if cap else "",
            f"{cap.vcpus_committed}/{cap.vcpus}" if cap else "",
            str(len(node.snapshots)),
            escape(node.url or ""),
        )
    out.print(table)
    up = sum(1 for n in fleet.nodes if n.healthy)
    console.print(f"{up}/{len(fleet.nodes)} nodes up; {fleet.lost_sandboxes} sandboxes lost")
