"""Upkeep a room runs in the background every so often, until the daemon closes it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable


class Periodic:
    """Runs `work` every `interval()` seconds (asked anew each time), after the first wait
    unless `at_once`. A pass that fails is logged and the next one comes anyway; a pass that
    returns True is the last."""

    def __init__(
        self,
        name: str,
        work: Callable[[], Awaitable[bool | None]],
        interval: Callable[[], float],
        log: logging.Logger,
        *,
        at_once: bool = False,
    ) -> None:
        self.name = name
        self.work = work
        self.interval = interval
        self.log = log
        self.at_once = at_once
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=self.name)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        if not self.at_once:
            await asyncio.sleep(self.interval())
        while True:
            try:
                if await self.work():
                    return
            except Exception:
                self.log.exception("%s failed", self.name)
            await asyncio.sleep(self.interval())
