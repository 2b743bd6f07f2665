"""`cella trace ID`: a sandbox's actions as a readable timeline (or JSON), and its lineage."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.text import Text
from rich.tree import Tree

from cella.cli._output import emit_json, out
from cella.models import Event, LineageNode
from cella.models.proctree import ExecTree, ProcessNode, exec_trees
from cella.sdk import Client

TREE_TYPES = ["exec", "process", "process_summary", "egress"]


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
        line = f"net {verdict} {d.get('host')}:{d.get('port')} {request} - {d.get('reason')}"
        who = d.get("process")
        if isinstance(who, dict):
            line += f" (pid {who.get('pid')} {_argv(who.get('argv'))})"
        return line
    if kind == "process":
        return f"process {d.get('pid')} (parent {d.get('ppid')}) {_argv(d.get('argv'))} " + (
            "running" if d.get("state") == "running" else _ended(d)
        )
    if kind == "process_summary":
        cut = ", truncated" if d.get("truncated") else ""
        counted = f"{d.get('dropped')} counted only{cut}"
        return f"processes of exec {d.get('exec')}: {d.get('total')} ({counted})"
    if kind in ("created", "forked"):
        extra = ", ".join(f"{k}={v}" for k, v in d.items())
        return f"{kind} ({extra})"
    if kind == "limit_hit":
        return f"limit hit: {d.get('limit')} -> {d.get('action')}"
    return kind + (f" {d}" if d else "")


def _argv(argv: Any, width: int = 80) -> str:
    text = " ".join(str(a) for a in argv) if isinstance(argv, list) else "?"
    return text if len(text) <= width else text[: width - 1] + "…"


def _ended(d: dict[str, Any]) -> str:
    status = f"signal {d['signal']}" if d.get("signal") else f"exit {d.get('exit_code')}"
    cpu = d.get("cpu_ms")
    return status + (f", {cpu:g} ms CPU" if isinstance(cpu, int | float) else "")


def _conn(c: dict[str, Any]) -> str:
    verdict = "allowed" if c.get("allowed") else "DENIED"
    sizes = (
        f", {_size(c.get('bytes_out'))} out, {_size(c.get('bytes_in'))} in, "
        f"{c.get('duration_ms')} ms"
        if "bytes_in" in c
        else ""
    )
    return f"-> {c.get('host')}:{c.get('port')} {verdict}{sizes}"


def _proc(node: ProcessNode, branch: Tree) -> None:
    state = "running" if node.state == "running" else _ended(node.model_dump())
    here = branch.add(Text(f"{node.pid} {_argv(node.argv)}  [{state}]"))
    for c in node.connections:
        here.add(Text(_conn(c)))
    for child in node.children:
        _proc(child, here)


def exec_tree(tree: ExecTree) -> Tree:
    """A command, the processes it started under their parents, their connections."""
    command = tree.command if isinstance(tree.command, str) else _argv(tree.command)
    root = Tree(Text(f"exec {tree.exec_id}: $ {command}  -> exit {tree.exit_code}"))
    for node in tree.processes:
        _proc(node, root)
    for c in tree.connections:
        root.add(Text(_conn(c)))
    s = tree.summary
    if s is None:
        root.add("(processes still running)")
    elif s.get("truncated"):
        root.add(f"… {s.get('total')} processes, {s.get('dropped')} counted only (truncated)")
    return root


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
    as_tree: Annotated[
        bool, typer.Option("--tree", help="each command's process tree and connections")
    ] = False,
    exec_id: Annotated[
        int | None, typer.Option("--exec", help="only this exec (its event id) and its processes")
    ] = None,
) -> None:
    """A sandbox's trace: lifecycle, commands (and the processes they started), file
    changes, network decisions (and the process that connected), in order."""
    with Client() as client:
        if as_tree:
            trees = exec_trees(client.events(sandbox_id, types=TREE_TYPES, exec_id=exec_id))
            if json_:
                for t in trees:
                    out.print_json(t.model_dump_json(), indent=None)
            for t in [] if json_ else trees:
                out.print(exec_tree(t))
            return
        if lineage:
            tree = client.lineage(sandbox_id)
            if json_:
                emit_json(tree.model_dump(mode="json"))
            else:
                out.print(_tree(tree, current=sandbox_id))
            return
        events = (
            client.follow(sandbox_id, types=type_, exec_id=exec_id)
            if follow
            else iter(client.events(sandbox_id, types=type_, exec_id=exec_id))
        )
        start = None
        for event in events:
            if json_:
                out.print_json(event.model_dump_json(), indent=None)
                continue
            start = start or event.at
            offset = (event.at - start).total_seconds()
            out.print(f"{event.at:%H:%M:%S} +{offset:8.3f}s  {describe(event)}", markup=False)
