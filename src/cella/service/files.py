"""Files in a sandbox: content streamed both ways, listings and bounded walks, metadata,
moves and owners, tar archives.

Owns the upload limit (a body over it is refused before anything is half-written), the
bounds of a walk (`cella.models.MAX_WALK_DEPTH`, `MAX_WALK_ENTRIES`) and the trace of every
change: `file_write` (path, size, mode, SHA-256), `mkdir`, `chmod`, `chown`, `file_move`,
`file_remove` and `archive_upload`. Paths arrive validated (`cella.models.GuestPath`).

The agent has no rename or chown of its own: a move and a chown are `mv` and `chown` run
by the exec room as argv (no shell), every operand after `--`, the paths absolute and the
names checked by `cella.models.account_name`, so nothing a caller sends becomes an option.
"""

from __future__ import annotations

import functools
import hashlib
import posixpath
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass

from cella import errors
from cella.guest.protocol import Entry
from cella.models import MAX_WALK_DEPTH, MAX_WALK_ENTRIES, ExecRequest, account_name
from cella.policy.access import Permission, Principal
from cella.runtime.contract import GuestAgent
from cella.service.exec import Exec
from cella.service.mount_files import MountFiles
from cella.service.registry import Registry

VIEW, EXEC = Permission.view, Permission.exec  # reading files is looking; changing them is not
Lister = Callable[[str], Awaitable[list[Entry]]]


class Files:
    def __init__(self, registry: Registry, exec_room: Exec, max_upload_bytes: int) -> None:
        self.registry = registry
        self.exec = exec_room
        self.events = registry.events
        self.max_upload_bytes = max_upload_bytes
        self.mounted = MountFiles(registry, exec_room)  # paths under volume, bucket mounts

    def _agent(self, who: Principal, sandbox_id: str, need: Permission = EXEC) -> GuestAgent:
        """The guest of a running sandbox the caller may `need` (reads: `view`)."""
        return self.registry.live(who, sandbox_id, need=need)[1].agent

    async def read(self, who: Principal, sandbox_id: str, path: str) -> AsyncIterator[bytes]:
        """The file's content, streamed; its first chunk is read before this returns, so a
        missing file is an error here rather than a cut stream."""
        if self.mounted.covers(sandbox_id, path):
            return await self.mounted.read(who, sandbox_id, path)
        return await _primed(self._agent(who, sandbox_id, VIEW).read_stream(path))

    async def write(
        self,
        who: Principal,
        sandbox_id: str,
        path: str,
        body: AsyncIterable[bytes],
        *,
        mode: int = 0o644,
        parents: bool = False,
        declared: int | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> Entry:
        """Replaces the file atomically with `body` (at most the upload limit), with
        `metadata` (kept as extended attributes; the old file's are not kept)."""
        digest = hashlib.sha256()
        content = _hashed(self._bounded(body, declared), digest)
        if self.mounted.covers(sandbox_id, path):
            if metadata:  # a mount's files live elsewhere; rclone keeps no extended attributes
                raise errors.InvalidArgument(f"{path} is on a mount, which keeps no file metadata")
            entry = await self.mounted.write(who, sandbox_id, path, content, mode, parents)
        else:
            agent = self._agent(who, sandbox_id)
            if metadata:
                await agent.write_file(path, content, mode=mode, parents=parents, metadata=metadata)
            else:
                await agent.write_file(path, content, mode=mode, parents=parents)
            entry = await agent.stat(path, metadata=bool(metadata))
            if metadata and entry.metadata != dict(metadata):  # an agent from before metadata
                raise errors.InvalidState(
                    f"{path} was written without its metadata: this sandbox's guest agent "
                    "predates file metadata (a sandbox booted anew has it)"
                )
        self.events.emit(
            sandbox_id,
            "file_write",
            {"path": path, "size": entry.size, "mode": mode, "sha256": digest.hexdigest()},
        )
        return entry

    async def list(
        self, who: Principal, sandbox_id: str, path: str, *, metadata: bool = False
    ) -> list[Entry]:
        """A directory's entries (with their `metadata`, if asked; a mount's have none)."""
        if self.mounted.covers(sandbox_id, path):
            return await self.mounted.list(who, sandbox_id, path)
        agent = self._agent(who, sandbox_id, VIEW)
        return await (agent.list_dir(path, metadata=True) if metadata else agent.list_dir(path))

    async def stat(
        self, who: Principal, sandbox_id: str, path: str, *, metadata: bool = False
    ) -> Entry:
        if self.mounted.covers(sandbox_id, path):
            return await self.mounted.stat(who, sandbox_id, path)
        agent = self._agent(who, sandbox_id, VIEW)
        return await (agent.stat(path, metadata=True) if metadata else agent.stat(path))

    def walk(
        self,
        who: Principal,
        sandbox_id: str,
        root: str,
        *,
        depth: int | None = 1,
        limit: int = MAX_WALK_ENTRIES,
        seconds: float | None = None,
        metadata: bool = False,
    ) -> Walk:
        """The entries under `root`, within bounds (see `Walk`); each directory is listed
        as `list` lists it, so a walk counts as activity and stops with the sandbox."""
        return Walk(
            functools.partial(self.list, who, sandbox_id, metadata=metadata),
            root,
            depth=depth,
            limit=limit,
            seconds=seconds,
        )

    async def move(
        self,
        who: Principal,
        sandbox_id: str,
        source: str,
        destination: str,
        *,
        user: str = "root",
        metadata: bool = False,
    ) -> Entry:
        """Renames `source` to `destination` (replacing a file there; a directory is not
        moved into one of that name), as `user`; the moved entry (with its `metadata`, if
        asked)."""
        await self.stat(who, sandbox_id, source)  # a missing source is NotFound
        argv = ["mv", "-T", "--", source, destination]
        done = await self.exec.run(who, sandbox_id, _as(user, argv), exempt=True)
        if done.exit_code != 0:
            raise errors.InvalidArgument(f"move failed: {done.stderr.decode(errors='replace')}")
        self.events.emit(sandbox_id, "file_move", {"source": source, "destination": destination})
        return await self.stat(who, sandbox_id, destination, metadata=metadata)

    async def chown(
        self,
        who: Principal,
        sandbox_id: str,
        path: str,
        user: str,
        group: str | None = None,
        *,
        recursive: bool = False,
    ) -> None:
        """Gives `path` (and, `recursive`, all below it) to `user` and `group` (without
        one, the user's login group)."""
        try:
            owner = f"{account_name(user)}:{account_name(group) if group else ''}"
        except ValueError as exc:
            raise errors.UnknownUser(str(exc)) from None
        await self.stat(who, sandbox_id, path)  # a missing path is NotFound
        argv = ["chown", *(["-R"] if recursive else []), "--", owner, path]
        done = await self.exec.run(who, sandbox_id, _as("root", argv), exempt=True)
        if done.exit_code != 0:
            stderr = done.stderr.decode(errors="replace").strip()
            raise errors.UnknownUser(f"cannot give {path} to {owner!r}: {stderr}")
        self.events.emit(
            sandbox_id,
            "chown",
            {"path": path, "user": user, "group": group, "recursive": recursive},
        )

    async def mkdir(
        self, who: Principal, sandbox_id: str, path: str, *, mode: int, parents: bool
    ) -> None:
        if self.mounted.covers(sandbox_id, path):
            await self.mounted.mkdir(who, sandbox_id, path, mode, parents)
        else:
            await self._agent(who, sandbox_id).mkdir(path, mode=mode, parents=parents)
        self.events.emit(sandbox_id, "mkdir", {"path": path, "mode": mode})

    async def chmod(self, who: Principal, sandbox_id: str, path: str, mode: int) -> None:
        if self.mounted.covers(sandbox_id, path):
            await self.mounted.chmod(who, sandbox_id, path, mode)
        else:
            await self._agent(who, sandbox_id).chmod(path, mode)
        self.events.emit(sandbox_id, "chmod", {"path": path, "mode": mode})

    async def remove(self, who: Principal, sandbox_id: str, path: str, *, recursive: bool) -> None:
        if self.mounted.covers(sandbox_id, path):
            await self.mounted.remove(who, sandbox_id, path, recursive)
        else:
            await self._agent(who, sandbox_id).remove(path, recursive=recursive)
        self.events.emit(sandbox_id, "file_remove", {"path": path, "recursive": recursive})

    async def download_archive(
        self, who: Principal, sandbox_id: str, path: str
    ) -> AsyncIterator[bytes]:
        """The directory as an uncompressed tar archive, streamed (primed like `read`)."""
        return await _primed(self._agent(who, sandbox_id, VIEW).tar_out(path))

    async def upload_archive(
        self,
        who: Principal,
        sandbox_id: str,
        path: str,
        body: AsyncIterable[bytes],
        declared: int | None = None,
    ) -> None:
        """Unpacks a tar archive into the directory (created if missing)."""
        agent = self._agent(who, sandbox_id)
        digest = hashlib.sha256()
        size = 0

        async def counted() -> AsyncIterator[bytes]:
            nonlocal size
            async for chunk in _hashed(self._bounded(body, declared), digest):
                size += len(chunk)
                yield chunk

        await agent.tar_in(path, counted())
        self.events.emit(
            sandbox_id, "archive_upload", {"path": path, "size": size, "sha256": digest.hexdigest()}
        )

    async def _bounded(
        self, body: AsyncIterable[bytes], declared: int | None
    ) -> AsyncIterator[bytes]:
        limit = self.max_upload_bytes
        if declared is not None and declared > limit:
            raise errors.PayloadTooLarge(f"upload of {declared} bytes exceeds {limit}")
        seen = 0
        async for chunk in body:
            seen += len(chunk)
            if seen > limit:
                raise errors.PayloadTooLarge(f"upload exceeds {limit} bytes")
            yield chunk


def _as(user: str, argv: list[str]) -> ExecRequest:
    """A command of the room's own, as `user`, from `/` (not the sandbox's exec defaults)."""
    return ExecRequest(command=argv, user=user, cwd="/")


@dataclass(frozen=True, slots=True)
class Found:
    """One entry of a walk: its absolute path, its path from the walk's root, and it."""

    path: str
    relative: str
    entry: Entry


class Walk:
    """The entries under a directory, breadth first, each directory's in name order, within
    bounds: `depth` levels (1: the root's own entries; None: as deep as MAX_WALK_DEPTH),
    at most `limit` entries (MAX_WALK_ENTRIES at most) and, if given, `seconds` of listing.
    Iterate it; when a bound ended it before the tree did, `truncated` is then set (the
    levels below a `depth` asked for are not a truncation). Links are entries, never
    followed. A directory that vanishes or refuses while walked is passed over; the root's
    errors are raised."""

    def __init__(
        self,
        lister: Lister,
        root: str,
        *,
        depth: int | None = 1,
        limit: int = MAX_WALK_ENTRIES,
        seconds: float | None = None,
    ) -> None:
        if depth is not None and not 1 <= depth <= MAX_WALK_DEPTH:
            raise errors.InvalidArgument(f"depth must be 1-{MAX_WALK_DEPTH}, not {depth}")
        if not 1 <= limit <= MAX_WALK_ENTRIES:
            raise errors.InvalidArgument(f"limit must be 1-{MAX_WALK_ENTRIES}, not {limit}")
        self.lister, self.root = lister, root
        self.depth, self.limit, self.seconds = depth, limit, seconds
        self.truncated = False

    async def __aiter__(self) -> AsyncIterator[Found]:
        deadline = None if self.seconds is None else time.monotonic() + self.seconds
        count = 0
        level = [(self.root, "")]
        for _ in range(self.depth or MAX_WALK_DEPTH):
            below = []
            for directory, relative in level:
                if deadline is not None and time.monotonic() > deadline:
                    self.truncated = True
                    return
                try:
                    entries = await self.lister(directory)
                except (errors.NotFound, errors.PermissionDenied, errors.NotADirectory):
                    if directory == self.root:
                        raise
                    continue  # gone or closed since its parent was listed
                for entry in entries:
                    if count == self.limit:
                        self.truncated = True
                        return
                    count += 1
                    found = Found(
                        posixpath.join(directory, entry.name),
                        posixpath.join(relative, entry.name),
                        entry,
                    )
                    yield found
                    if entry.kind == "dir":
                        below.append((found.path, found.relative))
            level = below
            if not level:
                return
        self.truncated = self.depth is None  # directories left at the deepest level


async def _hashed(stream: AsyncIterable[bytes], digest: hashlib._Hash) -> AsyncIterator[bytes]:
    async for chunk in stream:
        digest.update(chunk)
        yield chunk


async def _primed(stream: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    first = await anext(stream, b"")

    async def rest() -> AsyncIterator[bytes]:
        if first:
            yield first
        async for chunk in stream:
            yield chunk

    return rest()
