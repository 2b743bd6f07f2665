"""Waking on traffic: a sandbox made with `auto_resume` that is paused or stopped is
resumed by a request to its ports (service URLs, host names; E2B's envd), and the request
waits for it instead of failing. A wake after the lifetime ran out (an auto-pause) grants
the sandbox its first `ttl_seconds` again, at least `MIN_WAKE_SECONDS`, from the wake."""

from __future__ import annotations

import time

from cella import errors
from cella.models import SandboxState
from cella.policy.access import Principal
from cella.service.lifecycle import Lifecycle
from cella.service.registry import Registry
from cella.store import SandboxRecord

MIN_WAKE_SECONDS = 300  # E2B's floor for the lifetime an auto-resume grants
ASLEEP = (SandboxState.paused, SandboxState.stopped, SandboxState.stopping)


class Waking:
    def __init__(self, registry: Registry, lifecycle: Lifecycle) -> None:
        self.registry = registry
        self.lifecycle = lifecycle

    async def on_traffic(self, sandbox_id: str) -> SandboxRecord | None:
        """The sandbox as the traffic finds it: resumed first when it sleeps and asked to
        be woken (None: no such sandbox). Acts as the service: the caller's right to the
        port (a token, or a public port) is checked by the door it came through."""
        try:
            row = self.registry.row(sandbox_id)
        except errors.NotFound:
            return None
        if not row.auto_resume or row.state not in ASLEEP:
            return row
        service = Principal.service(row.tenant)
        now = time.time()
        if row.ttl_seconds and row.age_seconds(now) >= row.ttl_seconds - 1:
            # granted before it runs, or the reaper would find it expired again at once
            grant = max(MIN_WAKE_SECONDS, row.wake_ttl_seconds or 0)
            longer = int(row.age_seconds(now)) + grant
            await self.lifecycle.update(service, sandbox_id, ttl_seconds=longer)
        row = await self.lifecycle.awake(service, sandbox_id)
        self.registry.events.emit(sandbox_id, "woken", {"by": "traffic"})
        return row
