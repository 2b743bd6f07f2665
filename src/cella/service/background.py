"""Work a request starts and does not wait for (a LangSmith start or stop answered before it
is done, a template build streamed to a client that may leave, a directory watch): the
daemon keeps every such task, so none is lost to the garbage collector, and its shutdown
cancels what is still running."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

from cella import errors

T = TypeVar("T")
log = logging.getLogger("cella.background")


class Background:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def start(self, work: Coroutine[Any, Any, T], name: str | None = None) -> asyncio.Task[T]:
        """Runs `work` as a task of its own; its outcome is its own to report (a sandbox's
        state, a build's stream): a cella error is left at that, anything else is logged."""
        task = asyncio.create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._finished)
        return task

    def _finished(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()  # retrieved, so asyncio does not report it again
        if exc is not None and not isinstance(exc, errors.CellaError):
            log.error("background task %s failed", task.get_name(), exc_info=exc)

    async def close(self) -> None:
        """Cancels every task still running and waits for them to end."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
