"""The process trees of a sandbox's commands, put together from its trace events.

An `exec` event, the `process` events under it (`data.exec` is the exec's event id,
`data.parent.pid` the parent process), its `process_summary`, and the `egress` decisions
whose `process.exec` names it: one `ExecTree` each, for the SDK, the CLI and the console
alike. A process reported running when its command ended and again when it exited counts
once, as its latest report says.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from cella.models.sandbox import Event


class ProcessNode(BaseModel):
    pid: int
    ppid: int
    argv: list[str] = Field(default_factory=list)
    cwd: str | None = None
    uid: int | None = None
    state: str = "exited"  # or "running": still running when last reported
    started_at: str | None = None
    ended_at: str | None = None
    exit_code: int | None = None
    signal: int | None = None
    cpu_ms: float | None = None
    event_id: int = 0
    connections: list[dict[str, Any]] = Field(default_factory=list)
    children: list[ProcessNode] = Field(default_factory=list)


class ExecTree(BaseModel):
    exec_id: int
    command: Any = None
    exit_code: int | None = None
    started_at: str | None = None
    ended_at: str | None = None
    processes: list[ProcessNode] = Field(default_factory=list)  # the roots (the command's)
    summary: dict[str, Any] | None = None  # counts, `truncated`
    connections: list[dict[str, Any]] = Field(default_factory=list)  # of no process found

    def walk(self) -> list[ProcessNode]:
        """Every process, parents before their children."""
        out: list[ProcessNode] = []
        stack = list(reversed(self.processes))
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(reversed(node.children))
        return out


def exec_trees(events: list[Event]) -> list[ExecTree]:
    """One tree per exec that has a process trace, in the order the execs ended."""
    trees: dict[int, ExecTree] = {}
    procs: dict[int, dict[tuple[int, str | None], ProcessNode]] = {}
    for ev in events:
        data = ev.data
        if ev.type == "exec":
            trees[ev.id] = ExecTree(
                exec_id=ev.id,
                command=data.get("command"),
                exit_code=data.get("exit_code"),
                started_at=data.get("started_at"),
                ended_at=data.get("ended_at"),
            )
        elif ev.type == "process" and isinstance(data.get("exec"), int):
            fields = {k: data.get(k) for k in ProcessNode.model_fields if k in data}
            node = ProcessNode.model_validate({**fields, "event_id": ev.id})
            procs.setdefault(data["exec"], {})[(node.pid, node.started_at)] = node
        elif ev.type == "process_summary" and isinstance(data.get("exec"), int):
            tree = trees.get(data["exec"])
            if tree is not None:
                tree.summary = {k: v for k, v in data.items() if k not in ("exec", "parent")}
    out = []
    for exec_id, tree in trees.items():
        nodes = list(procs.get(exec_id, {}).values())
        if not nodes and tree.summary is None:
            continue  # not traced
        nodes.sort(key=lambda n: (n.started_at or "", n.pid))
        tree.processes = _link(nodes)
        out.append(tree)
    _connections(events, {t.exec_id: t for t in out})
    return out


def _link(nodes: list[ProcessNode]) -> list[ProcessNode]:
    """Each process under its parent: the latest process of that pid started before it."""
    by_pid: dict[int, list[ProcessNode]] = {}
    for node in nodes:
        by_pid.setdefault(node.pid, []).append(node)
    roots = []
    for node in nodes:
        candidates = [
            p
            for p in by_pid.get(node.ppid, [])
            if p is not node and (p.started_at or "") <= (node.started_at or "")
        ]
        if candidates:
            candidates[-1].children.append(node)
        else:
            roots.append(node)
    return roots


def _connections(events: list[Event], trees: dict[int, ExecTree]) -> None:
    for ev in events:
        who = ev.data.get("process") if ev.type == "egress" else None
        if not isinstance(who, dict) or who.get("exec") not in trees:
            continue
        tree = trees[who["exec"]]
        conn = {k: v for k, v in ev.data.items() if k != "process"} | {"event_id": ev.id}
        owner = next((n for n in reversed(tree.walk()) if n.pid == who.get("pid")), None)
        (owner.connections if owner is not None else tree.connections).append(conn)
