"""The one place sandbox events are written.

Every event (lifecycle, exec, file change, egress decision, limit hit) goes through
`EventLog.emit`, which replaces the tenant's secret values and the sandbox's placeholders
with `[secret:NAME]` before anything is stored or exported, then hands the event to the
sinks (OpenTelemetry) and wakes readers that follow the sandbox's events.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from cella.store import Store
from cella.store.db import now

log = logging.getLogger("cella.events")
MIN_REDACTED = 4  # shorter values would mangle every event; secrets are longer than this

Sink = Callable[[dict[str, Any]], None]


def redact(value: Any, pairs: list[tuple[str, str]]) -> Any:
    """`value` (nested dicts, lists, strings) with each secret string replaced."""
    if isinstance(value, str):
        for secret, mark in pairs:
            if secret in value:
                value = value.replace(secret, mark)
        return value
    if isinstance(value, dict):
        return {k: redact(v, pairs) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact(v, pairs) for v in value]
    return value


class EventLog:
    def __init__(self, store: Store) -> None:
        self.store = store
        self.sinks: list[Sink] = []
        self._tenant_values: dict[str, list[tuple[str, str]]] = {}
        self._placeholders: dict[str, tuple[str, list[tuple[str, str]]]] = {}
        self._waiters: dict[str, set[asyncio.Event]] = {}

    def secrets_changed(self, tenant: str) -> None:
        self._tenant_values.pop(tenant, None)

    def _pairs(self, sandbox_id: str) -> list[tuple[str, str]]:
        if sandbox_id not in self._placeholders:
            row = self.store.get_sandbox(sandbox_id)
            marks = (
                [(r.placeholder, f"[secret:{r.secret}]") for r in row.secrets.values()]
                if row
                else []
            )
            self._placeholders[sandbox_id] = (row.tenant if row else "", marks)
        tenant, marks = self._placeholders[sandbox_id]
        if tenant not in self._tenant_values:
            self._tenant_values[tenant] = [
                (s.value, f"[secret:{s.name}]")
                for s in self.store.list_secrets(tenant)
                if len(s.value) >= MIN_REDACTED
            ]
        pairs = marks + self._tenant_values[tenant]
        return sorted(pairs, key=lambda p: -len(p[0]))  # a longer secret may contain a shorter

    def emit(self, sandbox_id: str, type_: str, data: dict[str, Any] | None = None) -> int:
        clean = redact(data or {}, self._pairs(sandbox_id))
        event_id = self.store.add_event(sandbox_id, type_, clean)
        event = {
            "id": event_id,
            "sandbox_id": sandbox_id,
            "type": type_,
            "at": now(),
            "data": clean,
            "tenant": self._placeholders[sandbox_id][0],  # for the sinks' labels
        }
        for sink in self.sinks:
            try:
                sink(event)
            except Exception:
                log.exception("event sink failed")
        for waiter in self._waiters.get(sandbox_id, ()):
            waiter.set()
        return event_id

    async def wait(self, sandbox_id: str, timeout: float) -> None:
        """Returns when the sandbox has a new event, or after `timeout` seconds."""
        waiter = asyncio.Event()
        self._waiters.setdefault(sandbox_id, set()).add(waiter)
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(waiter.wait(), timeout)
        finally:
            waiters = self._waiters.get(sandbox_id, set())
            waiters.discard(waiter)
            if not waiters:
                self._waiters.pop(sandbox_id, None)
