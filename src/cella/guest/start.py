"""A template's start command: started in the guest (as the image's user, in its working
directory, with its env), left running, and waited for until its ready command exits 0.
Run before a template's warm snapshot is taken, so every sandbox restored from it has the
command running from its first moment."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Mapping, Sequence
from typing import Protocol

from cella import errors
from cella.models import ExecResult, ImageConfig, StartCommand

LOG = "/tmp/cella-start.log"  # the start command's output, where /tmp is writable
POLL_SECONDS = 0.5
# the command is the shell's $0, never spliced into a script: started in the background,
# its output to the log (or nowhere when the image has no writable /tmp)
LAUNCH = (
    f'log={LOG}; (: >>"$log") 2>/dev/null || log=/dev/null; '
    '/bin/sh -c "$0" >"$log" 2>&1 </dev/null &'
)


class Execs(Protocol):
    """The one thing `start` needs of a guest's agent (the channel's client, or a runtime's
    agent behind its contract)."""

    async def exec(
        self,
        argv: Sequence[str] | str,
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        user: str | None = None,
        timeout: float | None = None,
    ) -> ExecResult: ...


async def start(agent: Execs, command: StartCommand, config: ImageConfig) -> None:
    """Starts `command.command` (if any) and waits for `command.ready` (if any) to exit 0,
    within `ready_timeout_seconds`; a failure is `BuildFailed` with the start log's tail."""
    run = functools.partial(
        agent.exec, user=config.user or None, cwd=config.working_dir or None, env=config.env
    )
    if command.command:
        done = await run(["/bin/sh", "-c", LAUNCH, command.command], timeout=60)
        if done.exit_code != 0:
            text = (done.stdout + done.stderr).decode(errors="replace")[-1000:]
            raise errors.BuildFailed(f"the start command could not be started: {text}")
    if not command.ready:
        return
    deadline = time.monotonic() + command.ready_timeout_seconds
    last = b""
    while True:
        done = await run(["/bin/sh", "-c", command.ready], timeout=60)
        if done.exit_code == 0:
            return
        last = done.stdout + done.stderr
        if time.monotonic() > deadline:
            log = await agent.exec(["/bin/sh", "-c", f"tail -c 2000 {LOG}"], timeout=30)
            raise errors.BuildFailed(
                f"the ready command {command.ready!r} did not succeed within "
                f"{command.ready_timeout_seconds} s (last exit {done.exit_code}: "
                f"{last.decode(errors='replace')[-500:].strip()}); the start command's "
                f"output: {log.stdout.decode(errors='replace').strip()}"
            )
        await asyncio.sleep(POLL_SECONDS)
