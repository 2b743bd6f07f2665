"""`cella fleet ...`: a fleet gateway's view of its Ray cluster (admin)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape

from cella.cli._output import Listing, console, emit_json, out
from cella.models.fleet import MoveReport
from cella.sdk import Client

JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON.")]

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
        "cordoned",
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
            "yes" if node.cordoned else "",
            escape(node.url or ""),
        )
    out.print(table)
    up = sum(1 for n in fleet.nodes if n.healthy)
    console.print(f"{up}/{len(fleet.nodes)} nodes up; {fleet.lost_sandboxes} sandboxes lost")


@app.command()
def drain(node: str, json_: JsonOpt = False) -> None:
    """Cordon a node and move every sandbox on it to other nodes (same ids, running ones
    keep their processes); prints each move, then each sandbox left behind and why (one
    whose volume lives on the node stays with it). Exits 1 if any sandbox stayed."""
    with Client() as client:
        report = client.drain(node)
    stayed = [m for m in report.moves if not m.ok]
    if json_:
        emit_json(report.model_dump(mode="json", by_alias=True))
    else:
        show_moves(report.moves)
        for m in stayed:
            console.print(f"[red]left on {escape(node)}[/red] {m.id}: {escape(m.error or '')}")
        moved = len(report.moves) - len(stayed)
        console.print(f"{moved} moved, {len(stayed)} left; node {escape(node)} is cordoned: "
                      f"`cella fleet uncordon {escape(node)}`")  # fmt: skip
    if stayed:
        raise typer.Exit(1)


@app.command()
def move(
    sandbox_id: str,
    node: Annotated[str | None, typer.Option("--node", help="The node to move it to.")] = None,
    json_: JsonOpt = False,
) -> None:
    """Move one sandbox to another node (`--node`, else the gateway picks one)."""
    with Client() as client:
        report = client.get(sandbox_id).move(node)
    if json_:
        emit_json(report.model_dump(mode="json", by_alias=True))
    else:
        show_moves([report])


@app.command()
def cordon(node: str) -> None:
    """Place nothing new on a node; what runs there stays."""
    with Client() as client:
        client.cordon(node)
    console.print(f"node {escape(node)} is cordoned")


@app.command()
def uncordon(node: str) -> None:
    """Let new sandboxes be placed on a node again."""
    with Client() as client:
        client.uncordon(node)
    console.print(f"node {escape(node)} takes new sandboxes again")


def show_moves(moves: list[MoveReport]) -> None:
    table = Listing(
        "sandbox", "from", "to", "state", "pre-copy ms", "MiB before", "pause ms",
        "MiB frozen", "transfer ms", "error", ids=("sandbox",), give_way={"error": 20},
    )  # fmt: skip
    for m in moves:
        table.add_row(
            m.id,
            escape(m.source),
            escape(m.to or ""),
            m.state,
            "" if m.precopy_ms is None else f"{m.precopy_ms:.0f}",
            "" if m.precopy_bytes is None else f"{m.precopy_bytes / (1 << 20):.1f}",
            "" if m.paused_ms is None else f"{m.paused_ms:.0f}",
            "" if m.bytes is None else f"{m.bytes / (1 << 20):.1f}",
            "" if m.transfer_ms is None else f"{m.transfer_ms:.0f}",
            f"[red]{escape(m.error)}[/red]" if m.error else "",
        )
    out.print(table)
