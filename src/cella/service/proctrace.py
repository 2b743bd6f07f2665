"""The processes a command started, as `process` events under its `exec` event.

The guest agent reports each traced exec's processes (from the kernel's proc connector) in
batches naming the exec's channel. An exec's `exec` event is written when it ends, so the
records of a command still running are held (at most the guest's per-exec bound) and
written right after it, each with `parent: {exec: <exec event id>, pid: <parent pid>}`;
those of processes it left running come later and are written at once. A `process_summary`
event closes an exec's processes: how many, how many recorded, `truncated` when some were
only counted.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from cella.guest.protocol import Owner, ProcRecord, ProcSummary
from cella.service.registry import iso
from cella.telemetry.events import EventLog

# Execs remembered per sandbox after they ended (their background processes report later).
MAX_ENDED = 256
# Connections of one running exec linked to it when it ends (later ones are not).
MAX_CONNECTIONS = 10000


@dataclass(slots=True)
class _Exec:
    event_id: int | None = None  # set once the exec's event is written
    held: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    taken: int = 0  # records kept: a guest sending more than it may is not heard
    connections: list[int] = field(default_factory=list)  # egress events made while it ran


class ProcessTrace:
    def __init__(self, events: EventLog, limit: int) -> None:
        self.events = events
        self.limit = limit  # processes of one exec recorded in full
        self._execs: dict[str, OrderedDict[int, _Exec]] = {}

    def watch(self, sandbox_id: str, agent: Any) -> None:
        """Takes the process records of the sandbox's agent (once per agent)."""
        if getattr(agent, "on_procs", None) is None:
            agent.on_procs = functools.partial(self._records, sandbox_id)

    def started(self, sandbox_id: str, channel: int) -> None:
        """A traced exec started on `channel`: its records are held until it ends (some
        may have come before the exec's start reached its caller)."""
        self._exec(sandbox_id, channel)

    def _exec(self, sandbox_id: str, channel: int) -> _Exec:
        execs = self._execs.setdefault(sandbox_id, OrderedDict())
        ex = execs.get(channel)
        if ex is None:
            ex = execs[channel] = _Exec()
            while len(execs) > MAX_ENDED:
                execs.popitem(last=False)
        return ex

    def ended(self, sandbox_id: str, channel: int, event_id: int) -> None:
        """The exec's event is `event_id`: what was held is written under it."""
        execs = self._execs.get(sandbox_id)
        ex = execs.get(channel) if execs is not None else None
        if ex is None:
            return
        ex.event_id = event_id
        held, ex.held = ex.held, []
        for type_, data in held:
            self._write(sandbox_id, ex, type_, data)
        if ex.connections:
            self.events.store.link_to_exec(sandbox_id, ex.connections, event_id)
            ex.connections = []

    def connection(self, sandbox_id: str, owner: Owner, event_id: int) -> None:
        """An egress event of a connection `owner` opened: one made while its exec runs
        is linked to the exec's event once that is written."""
        execs = self._execs.get(sandbox_id)
        ex = execs.get(owner.channel) if execs is not None and owner.channel else None
        if ex is not None and ex.event_id is None and len(ex.connections) < MAX_CONNECTIONS:
            ex.connections.append(event_id)

    def forget(self, sandbox_id: str) -> None:
        self._execs.pop(sandbox_id, None)

    def exec_of(self, sandbox_id: str, owner: Owner | None) -> int | None:
        """The exec event a connection's opener belongs to, once written."""
        if owner is None or not owner.channel:
            return None
        execs = self._execs.get(sandbox_id)
        ex = execs.get(owner.channel) if execs is not None else None
        return ex.event_id if ex is not None else None

    def _records(self, sandbox_id: str, records: list[ProcRecord | ProcSummary]) -> None:
        for record in records:
            ex = self._exec(sandbox_id, record.channel)
            if isinstance(record, ProcSummary):
                item: tuple[str, dict[str, Any]] = ("process_summary", _summary(record))
            else:
                item = ("process", _process(record))
            # each process may be reported running and then exited, and there is one summary
            if ex.taken > 2 * self.limit:
                continue
            ex.taken += 1
            if ex.event_id is None:
                ex.held.append(item)
            else:
                self._write(sandbox_id, ex, *item)

    def _write(self, sandbox_id: str, ex: _Exec, type_: str, data: dict[str, Any]) -> None:
        data["parent"] = {"exec": ex.event_id, **data.get("parent", {})}
        data["exec"] = ex.event_id
        self.events.emit(sandbox_id, type_, data)


def _ms(value: int | None) -> str | None:
    return iso(value / 1000) if value else None


def _process(r: ProcRecord) -> dict[str, Any]:
    return {
        "parent": {"pid": r.ppid},
        "pid": r.pid,
        "ppid": r.ppid,
        "argv": r.argv,
        "cwd": r.cwd,
        "uid": r.uid,
        "state": "running" if r.end_ms is None else "exited",
        "started_at": _ms(r.start_ms),
        "ended_at": _ms(r.end_ms),
        "exit_code": r.exit_code,
        "signal": r.signal,
        "cpu_ms": r.cpu_ms,
    }


def _summary(s: ProcSummary) -> dict[str, Any]:
    return {
        "total": s.total,
        "recorded": s.recorded,
        "dropped": s.dropped,
        "truncated": s.dropped > 0 or s.lost,
        "lost": s.lost,
    }
