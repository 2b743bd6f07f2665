"""Which nodes answer the planner: a node that is up in Ray's eyes but whose daemon hangs or
refuses is left out of placements for a while, growing with each failure in a row, rather
than asked (and waited for) on every create; its first answer after that clears it."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

log = logging.getLogger("cella.fleet")
T = TypeVar("T")

FIRST_PAUSE_S = 5.0  # how long a node is left out after its first failure
LONGEST_PAUSE_S = 60.0  # and at most, however often it failed


@dataclass(slots=True)
class Silence:
    failures: int
    until: float  # monotonic: asked again from then on
    reason: str


class Answering:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._silent: dict[str, Silence] = {}

    def left_out(self) -> set[str]:
        """The nodes not to ask now."""
        now = self.clock()
        return {name for name, s in self._silent.items() if s.until > now}

    def reason(self, name: str) -> str | None:
        """Why the node is left out, if it is."""
        found = self._silent.get(name)
        return found.reason if found is not None and found.until > self.clock() else None

    def failed(self, name: str, reason: str) -> None:
        failures = self._silent[name].failures + 1 if name in self._silent else 1
        pause = min(LONGEST_PAUSE_S, FIRST_PAUSE_S * 2 ** (failures - 1))
        self._silent[name] = Silence(failures, self.clock() + pause, reason)
        log.warning("node %s left out of placements for %.0f s: %s", name, pause, reason)

    def answered(self, name: str) -> None:
        if self._silent.pop(name, None) is not None:
            log.info("node %s answers again: placed on again", name)

    async def ask(self, name: str, call: Callable[[], Awaitable[T]]) -> T | None:
        """`call`'s answer, or None (the failure recorded) if it raised."""
        try:
            answer = await call()
        except Exception as exc:  # a hang (timed out), a refusal, a bad answer alike
            self.failed(name, str(exc) or type(exc).__name__)  # a timeout says nothing
            return None
        self.answered(name)
        return answer
