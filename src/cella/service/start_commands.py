"""What a template has running from its warm snapshot, started again on a boot from disk.

A sandbox restored from memory has its template's start command (an image's, E2B's
`setStartCmd`) and its `warm` commands' servers (a built-in template's: dockerd, the code
interpreter) running from its first moment. One booted from its disk alone (a resume after
a stop, E2B's filesystem-only pause, a fork of a snapshot without memory, anything stopped
by a host restart) starts with none of them: this room starts them again, the way the
warm snapshot did, before the sandbox is handed back as running. A start command that
fails does not fail the boot (the sandbox's files are intact and its user can look into
why): it is reported as the sandbox's `start_failed` event.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from cella import errors
from cella.guest.start import start
from cella.images.templates import builtin_templates, start_of
from cella.paths import Paths
from cella.runtime.contract import VM
from cella.telemetry.events import EventLog

log = logging.getLogger("cella.start_commands")
WARM_TIMEOUT = 600.0  # as long as a warm snapshot gives each


@dataclass(frozen=True)
class Started:
    """What a boot from disk ran: each command, and the error of the one that failed."""

    commands: list[str]
    error: str | None = None


class StartCommands:
    def __init__(self, paths: Paths, events: EventLog) -> None:
        self.paths = paths
        self.events = events

    async def run(self, vm: VM, sandbox_id: str, template: str) -> Started:
        """Runs `template`'s warm commands and start command (waited for until ready) in a
        guest booted from its disk; never raises for a command that fails."""
        ran: list[str] = []
        try:
            spec = builtin_templates().get(template)
            for command in spec.warm if spec else []:
                ran.append(command)
                done = await vm.agent.exec(["/bin/sh", "-c", command], timeout=WARM_TIMEOUT)
                if done.exit_code != 0:
                    tail = (done.stdout + done.stderr).decode(errors="replace")[-1000:]
                    raise errors.BuildFailed(f"{command!r} exited {done.exit_code}: {tail}")
            if started := start_of(self.paths, template):
                spec_start, config = started
                ran.append(spec_start.command or spec_start.ready or "")
                await start(vm.agent, spec_start, config)
        except (errors.CellaError, OSError, TimeoutError) as exc:
            log.warning("sandbox %s: start command failed: %s", sandbox_id, exc)
            self.events.emit(sandbox_id, "start_failed", {"commands": ran, "error": str(exc)})
            return Started(ran, str(exc))
        if ran:
            self.events.emit(sandbox_id, "started", {"commands": ran})
        return Started(ran)
