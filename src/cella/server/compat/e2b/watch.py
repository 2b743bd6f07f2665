"""Watching a directory for E2B's SDK: the guest's listing is polled (the agent has no
inotify) and compared, so creations, writes (size or mtime changed) and removals are seen
within a poll; a rename shows as a removal and a creation. A recursive watch sees what the
files room's walk reaches (its bounds on depth and entries), directories made after it
started included. Asked to, events carry the entry (E2B's `include_entry`). A watcher
nobody reads for `IDLE` seconds stops by itself."""

from __future__ import annotations

import asyncio
import contextlib
import posixpath
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from cella import errors
from cella.guest.protocol import Entry
from cella.policy.access import Principal
from cella.service.background import Background
from cella.service.files import Files

POLL = 0.25
IDLE = 600.0
Seen = dict[str, Entry]  # relative path -> what it was
# how an event's entry is shown (E2B's EntryInfo, given the entry and its absolute path)
Shown = Callable[[Entry, str], dict[str, Any]]


async def listing(
    files: Files, who: Principal, sandbox_id: str, root: str, recursive: bool, metadata: bool
) -> Seen:
    """What is under `root` now; a recursive watch walks it all each time, so directories
    made since it started are watched too."""
    depth = None if recursive else 1
    walk = files.walk(who, sandbox_id, root, depth=depth, metadata=metadata)
    return {found.relative: found.entry async for found in walk}


def _changed(before: Entry, after: Entry) -> bool:
    return (before.kind, before.size, before.mtime_ns) != (after.kind, after.size, after.mtime_ns)


def changes(
    before: Seen, after: Seen, root: str = "/", shown: Shown | None = None
) -> list[dict[str, Any]]:
    """E2B's FilesystemEvent JSON for what differs between two listings; with `shown`, a
    creation or a write carries the entry as it is now (a removal never does)."""
    found = []

    def event(name: str, kind: str, entry: Entry | None = None) -> None:
        shape: dict[str, Any] = {"name": name, "type": kind}
        if entry is not None and shown is not None:
            shape["entry"] = shown(entry, posixpath.join(root, name))
        found.append(shape)

    for name in sorted(after.keys() - before.keys()):
        event(name, "EVENT_TYPE_CREATE", after[name])
    for name in sorted(before.keys() & after.keys()):
        if _changed(before[name], after[name]) and after[name].kind != "dir":
            event(name, "EVENT_TYPE_WRITE", after[name])
    for name in sorted(before.keys() - after.keys()):
        event(name, "EVENT_TYPE_REMOVE")
    return found


@dataclass(eq=False)
class Watcher:
    id: str
    who: Principal
    sandbox_id: str
    root: str
    recursive: bool
    files: Files
    seen: Seen
    shown: Shown | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    last_read: float = field(default_factory=time.monotonic)
    task: asyncio.Task[None] | None = None

    async def poll(self) -> None:
        while time.monotonic() - self.last_read < IDLE:
            await asyncio.sleep(POLL)
            try:
                now = await listing(
                    self.files,
                    self.who,
                    self.sandbox_id,
                    self.root,
                    self.recursive,
                    self.shown is not None,
                )
            except errors.CellaError:
                return  # the directory or the sandbox went away
            self.events += changes(self.seen, now, self.root, self.shown)
            self.seen = now


class Watchers:
    def __init__(self) -> None:
        self._all: dict[str, Watcher] = {}

    async def create(
        self,
        background: Background,
        files: Files,
        who: Principal,
        sandbox_id: str,
        root: str,
        recursive: bool,
        shown: Shown | None = None,
    ) -> Watcher:
        """A watch of `root`; with `shown`, its events carry their entries."""
        entry = await files.stat(who, sandbox_id, root)
        if entry.kind != "dir":
            raise errors.NotADirectory(f"{root} is not a directory")
        seen = await listing(files, who, sandbox_id, root, recursive, shown is not None)
        watcher = Watcher(
            secrets.token_hex(8), who, sandbox_id, root, recursive, files, seen, shown
        )
        # the daemon's task: its shutdown stops the poll
        watcher.task = background.start(watcher.poll(), name=f"watch-{watcher.id}")
        watcher.task.add_done_callback(lambda _: self._all.pop(watcher.id, None))
        self._all[watcher.id] = watcher
        return watcher

    def get(self, sandbox_id: str, watcher_id: str) -> Watcher:
        found = self._all.get(watcher_id)
        if found is None or found.sandbox_id != sandbox_id:
            raise errors.NotFound(f"no watcher {watcher_id!r}")
        return found

    def take(self, sandbox_id: str, watcher_id: str) -> list[dict[str, Any]]:
        watcher = self.get(sandbox_id, watcher_id)
        watcher.last_read = time.monotonic()
        events, watcher.events = watcher.events, []
        return events

    async def remove(self, sandbox_id: str, watcher_id: str) -> None:
        watcher = self.get(sandbox_id, watcher_id)
        if watcher.task is not None:
            watcher.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher.task

    async def stream(self, watcher: Watcher) -> AsyncIterator[dict[str, Any]]:
        """WatchDir: `start`, then events as they are seen, until the client leaves."""
        yield {"start": {}}
        try:
            while watcher.task is not None and not watcher.task.done():
                watcher.last_read = time.monotonic()
                events, watcher.events = watcher.events, []
                for event in events:
                    yield {"filesystem": event}
                await asyncio.sleep(POLL)
        finally:
            await self.remove(watcher.sandbox_id, watcher.id)
