"""`cella trace ID`: a sandbox's actions as a readable timeline (or JSON), and its lineage."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.tree import Tree

from cella.cli._output import emit_json, out
from cella.models import Event, LineageNode
from cella.sdk import Client


def _size(n: Any) -> str:
    return f"{n} B" if isinstance(n, int) else "?"


def describe(event: Event) -> str:
    """One line for an event: what happened, in the words of the timeline."""
    d = event.data
    kind = event.type
    if kind == "exec":
        command = d.get("command")
        text = command if isinstance(command, str) else " ".join(command or [])
        status = "timed out" if d.get("timed_out") else f"exit {d.get('exit_code')}"
        return (
            f"$ {text}  -> {status} in {d.get('duration_ms')} ms, "
            f"{_size(d.get('stdout_bytes'))} out, {_size(d.get('stderr_bytes'))} err"
        )
    if kind == "file_write":
        return f"wrote {d.get('path')} ({_size(d.get('size'))}, sha256 {str(d.get('sha256'))[:12]})"
    if kind == "file_remove":
        return f"removed {d.get('path')}" + (" (recursive)" if d.get("recursive") else "")
    if kind == "file_move":
        return f"moved {d.get('source')} to {d.get('destination')}"
    if kind == "chown":
        owner = f"{d.get('user')}:{d.get('group') or ''}"
        return f"gave {d.get('path')} to {owner}" + (" (recursive)" if d.get("recursive") else "")
    if kind == "archive_upload":
        return f"unpacked an archive into {d.get('path')} ({_size(d.get('size'))})"
    if kind == "egress":
        verdict = "allowed" if d.get("allowed") else "DENIED"
        request = " ".join(str(x) for x in (d.get("method"), d.get("status")) if x)
        return f"net {verdict} {d.get('host')}:{d.get('port')} {request} - {d.get('reason')}"
    if kind in ("created", "forked"):
        extra = ", ".join(f"{k}={v}" for k, v in d.items())
        return f"{kind} ({extra})"
    if kind == "limit_hit":
        return f"limit hit: {d.get('limit')} -> {d.get('action')}"
    return kind + (f" {d}" if d else "")


def _tree(node: LineageNode, branch: Tree | None = None, current: str = "") -> Tree:
    label = f"{node.kind} {node.id} [{node.state}]" + (f" {node.name!r}" if node.name else "")
    if node.id == current:
        label = f"[bold]{label}[/bold] <- this one"
    here = Tree(label) if branch is None else branch.add(label)
    for child in node.children:
        _tree(child, here, current)
    return here


def trace(
    sandbox_id: str,
    json_: Annotated[bool, typer.Option("--json", help="JSON Lines, one event each")] = False,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="keep printing new events")
    ] = False,
    type_: Annotated[list[str] | None, typer.Option("--type", help="only these types")] = None,
    lineage: Annotated[bool, typer.Option(help="show the snapshot/fork family tree")] = False,
) -> None:
    """A sandbox's trace: lifecycle, commands, file changes, network decisions, in order."""
    with Client() as client:
        if lineage:
            tree = client.lineage(sandbox_id)
            if json_:
                emit_json(tree.model_dump(mode="json"))
            else:
                out.print(_tree(tree, current=sandbox_id))
            return
        events = (
            client.follow(sandbox_id, types=type_)
            if follow
            else iter(client.events(sandbox_id, types=type_))
        )
        start = None
        for event in events:
            if json_:
                out.print_json(event.model_dump_json(), indent=None)
                continue
            start = start or event.at
            offset = (event.at - start).total_seconds()
            out.print(f"{event.at:%H:%M:%S} +{offset:8.3f}s  {describe(event)}", markup=False)
