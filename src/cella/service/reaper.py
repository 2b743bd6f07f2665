"""The reaper: wall-clock TTLs and idle timeouts, enforced from the store (so a restarted
daemon picks up where the last one was). `due()` decides, `Reaper` acts."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from cella import errors
from cella.models import SandboxState
from cella.policy.access import Principal
from cella.service.lifecycle import Lifecycle
from cella.service.registry import Registry
from cella.store import SandboxRecord
from cella.store.records import epoch

log = logging.getLogger("cella.reaper")
S = SandboxState
WATCHED = (S.running, S.paused, S.stopped)


@dataclass(frozen=True, slots=True)
class Expiry:
    sandbox: SandboxRecord
    limit: str  # "ttl" or "idle"
    action: str  # "stop", "pause" or "delete"


def due(rows: Iterable[SandboxRecord], now: float, busy: Callable[[str], bool]) -> list[Expiry]:
    """The limits that have run out, and what each one does. A TTL that would leave the
    sandbox as it is (stop a stopped one, pause a paused one) is not due; an exec under way
    keeps a sandbox from being idle; a stopped sandbox (also one whose stop kept its memory,
    paused since) may be deleted some time after."""
    out = []
    for row in rows:
        if (
            row.state in (S.stopped, S.paused)
            and row.delete_after_stop_seconds
            and row.stopped_at
            and now - epoch(row.stopped_at) >= row.delete_after_stop_seconds
        ):
            out.append(Expiry(row, "stopped", "delete"))
            continue
        if row.ttl_seconds and row.age_seconds(now) >= row.ttl_seconds:
            action = row.ttl_action
            if row.state == S.stopped and action != "delete":
                continue
            if row.state == S.paused and action == "pause":
                continue
            out.append(Expiry(row, "ttl", action))
        elif (
            row.idle_timeout_seconds
            and row.state == S.running
            and not busy(row.id)
            and row.idle_seconds(now) >= row.idle_timeout_seconds
        ):
            out.append(Expiry(row, "idle", row.idle_action))
    return out


class Reaper:
    def __init__(self, registry: Registry, lifecycle: Lifecycle, interval: float) -> None:
        self.registry = registry
        self.lifecycle = lifecycle
        self.interval = interval
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="cella-reaper")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            try:
                await self.once()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("reaper pass failed")
            await asyncio.sleep(self.interval)

    async def once(self) -> None:
        rows = self.registry.store.list_sandboxes(None, [s.value for s in WATCHED])
        for expiry in due(rows, time.time(), self.registry.is_busy):
            await self.expire(expiry)

    async def expire(self, expiry: Expiry) -> None:
        row = expiry.sandbox
        self.registry.events.emit(
            row.id, "limit_hit", {"limit": expiry.limit, "action": expiry.action}
        )
        log.info("%s of %s expired: %s", expiry.limit, row.id, expiry.action)
        service = Principal.service(row.tenant)
        with contextlib.suppress(errors.NotFound, errors.InvalidState):
            if expiry.action == "delete":
                await self.lifecycle.delete(service, row.id)
            elif expiry.action == "pause":
                await self.lifecycle.pause(service, row.id)
            else:
                await self.lifecycle.stop(service, row.id)
