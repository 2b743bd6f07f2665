"""Commands in a sandbox: streamed or run to completion, each one traced.

Owns the environment every exec gets (egress proxy variables, secret placeholders, the
sandbox's exec defaults under the command's own user, cwd and env), the
activity an exec counts as (a sandbox with an exec under way is never idle) and the `exec`
trace event: command, cwd, times, exit status, output sizes, digest and tail.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import Any

from cella.guest.client import ExecControl, ExecEvent, Output, Started
from cella.guest.protocol import ExitStatus
from cella.models import ExecRequest, ExecResult, OutputCollector
from cella.policy.access import Permission, Principal
from cella.service.egress import SandboxEgress
from cella.service.proctrace import ProcessTrace
from cella.service.registry import Registry, iso
from cella.store import SandboxRecord

# what runs after a caller's command ended (a checkpoint, for a sandbox that takes one each)
AfterCommand = Callable[[Principal, SandboxRecord, object], Awaitable[None]]


class Exec:
    def __init__(
        self, registry: Registry, egress: SandboxEgress, procs: ProcessTrace, keep: int
    ) -> None:
        self.registry = registry
        self.egress = egress
        self.procs = procs
        self.keep = keep  # output of a run kept per stream
        self.after_command: AfterCommand | None = None

    def check(self, who: Principal, sandbox_id: str) -> None:
        """Fails now (not found, not running) rather than in the middle of a stream."""
        self.registry.live(who, sandbox_id)

    async def stream(
        self,
        who: Principal,
        sandbox_id: str,
        req: ExecRequest,
        output: OutputCollector | None = None,
        *,
        stdin: AsyncIterable[bytes] | None = None,
        pty: tuple[int, int] | None = None,
        control: ExecControl | None = None,
        activity: bool = True,
        need: Permission = Permission.exec,
        exempt: bool = False,
        caller: bool = False,
    ) -> AsyncIterator[ExecEvent]:
        """Started, then output as produced, then the exit status. `stdin` (an open-ended
        source, instead of the request's fixed bytes), `pty` and `control` are for callers
        that keep a command interactive (processes, terminals); without `activity` (the daemon's
        own upkeep) the command does not count against the sandbox's idleness. `need`: a
        read the service runs as a fixed command (a byte range of a file) needs `view`.
        `exempt`: a fixed command of the service's own (a move, a read), which the
        sandbox's exec policy does not hold, as it does not hold the daemon's upkeep.
        `caller`: the caller's own command (not one the service runs for a file call),
        after which `after_command` runs (the checkpoint of `checkpoint_each_exec`)."""
        row, vm = self.registry.live(who, sandbox_id, activity, need)  # one store read
        output = output or OutputCollector(keep=0)
        kwargs = req.agent_kwargs()
        defaults = row.exec_defaults
        kwargs["env"] = {**self.egress.guest_env(row), **defaults.env, **kwargs["env"]}
        kwargs["user"] = kwargs["user"] or defaults.user
        kwargs["cwd"] = kwargs["cwd"] or defaults.cwd
        if stdin is not None:
            kwargs["stdin"] = stdin
        kwargs["pty"], kwargs["control"] = pty, control
        kwargs["exempt"] = exempt or not activity
        # the sandbox's own commands, not the daemon's upkeep, have their processes traced
        trace_on = activity and defaults.trace_processes
        kwargs["trace"] = self.procs.limit if trace_on else 0
        if trace_on:
            self.procs.watch(sandbox_id, vm.agent)
        channel = 0
        started_at = time.time()
        start = time.monotonic()
        status: ExitStatus | None = None
        with self.registry.busy(sandbox_id) if activity else contextlib.nullcontext():
            try:
                async for event in vm.agent.exec_stream(req.command, **kwargs):
                    if isinstance(event, Output):
                        output.add(event.stream, event.data)
                    elif isinstance(event, Started) and trace_on:
                        channel = event.channel
                        self.procs.started(sandbox_id, channel)
                    elif isinstance(event, ExitStatus):
                        status = event
                    yield event
            finally:
                changes = status.file_changes if status else None
                parent = self.registry.events.emit(
                    sandbox_id,
                    "exec",
                    {
                        "command": req.command,
                        "cwd": req.cwd,
                        "started_at": iso(started_at),
                        "ended_at": iso(time.time()),
                        "exit_code": status.exit_code if status else None,
                        "timed_out": status.timed_out if status else None,
                        "duration_ms": round((time.monotonic() - start) * 1000, 1),
                        **output.trace(),
                        **({"files_changed": len(changes)} if changes is not None else {}),
                    },
                )
                if status is not None and (changes or status.changes_dropped):
                    self.registry.events.emit(sandbox_id, "file_changes", traced(parent, status))
                if channel:
                    self.procs.ended(sandbox_id, channel, parent)
        if caller and status is not None and self.after_command is not None:
            await self.after_command(who, row, req.command)

    async def run(
        self,
        who: Principal,
        sandbox_id: str,
        req: ExecRequest,
        keep: int | None = None,
        activity: bool = True,
        exempt: bool = False,
        caller: bool = False,
    ) -> ExecResult:
        """Runs to completion; up to `keep` bytes of each stream (default: the daemon's
        setting) are kept in the result, which says how much more there was."""
        output = OutputCollector(keep=self.keep if keep is None else keep)
        start = time.monotonic()
        status: ExitStatus | None = None
        async for event in self.stream(
            who, sandbox_id, req, output, activity=activity, caller=caller, exempt=exempt
        ):
            if isinstance(event, ExitStatus):
                status = event
        assert status is not None
        duration_ms = (time.monotonic() - start) * 1000
        return output.result(status.exit_code, status.signal, status.timed_out, duration_ms)


def traced(parent: int, status: ExitStatus) -> dict[str, Any]:
    """A command's file changes as a trace event under its `exec` event (`parent`)."""
    changes = []
    for c in status.file_changes or ():
        item: dict[str, Any] = {"path": c.path, "change": c.change, "size": c.size}
        if c.is_dir:
            item["dir"] = True
        if c.source is not None:
            item["from"] = c.source
        changes.append(item)
    return {"parent": parent, "changes": changes, "truncated": status.changes_dropped}
