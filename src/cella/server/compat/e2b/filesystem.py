"""envd's `filesystem.Filesystem`: entries stated, listed to a depth (the files room's
walk), made, moved, removed and watched, paths relative to the home of the user the SDK
acts as, and what it makes given to that user."""

from __future__ import annotations

import posixpath
import stat as stat_mod
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request, Response

from cella import errors
from cella.guest.protocol import Entry
from cella.models import MAX_WALK_ENTRIES
from cella.server.compat.e2b import connect
from cella.server.compat.e2b.target import DEFAULT_USER, Target, first_missing, own, target
from cella.server.compat.e2b.watch import Watcher, Watchers

KINDS = {"file": "FILE_TYPE_FILE", "dir": "FILE_TYPE_DIRECTORY", "symlink": "FILE_TYPE_SYMLINK"}
TYPE_BITS = {"file": stat_mod.S_IFREG, "dir": stat_mod.S_IFDIR, "symlink": stat_mod.S_IFLNK}
OWNERS = {0: "root", 1000: DEFAULT_USER}


router = APIRouter(include_in_schema=False)


@router.post("/filesystem.Filesystem/WatchDir")
async def watch_dir(request: Request) -> Response:
    """The async SDK's watch: a stream of events."""
    where = await target(request)
    body = await connect.read_first(request)
    watcher = await new_watcher(where, body)
    every = connect.keepalive_interval(request)
    return connect.stream(WATCHERS.stream(watcher), {"keepalive": {}}, every)


@router.post("/filesystem.Filesystem/{method}")
async def filesystem(method: str, request: Request) -> Response:
    where = await target(request)
    handler = connect.method_of(FILESYSTEM, "filesystem.Filesystem", method)
    body = await connect.read_unary(request)
    return connect.unary(await handler(where, body))


def entry_json(entry: Entry, path: str) -> dict[str, Any]:
    mtime = datetime.fromtimestamp(entry.mtime_ns / 1e9, UTC)
    shown: dict[str, Any] = {
        "name": posixpath.basename(path) or "/",
        "type": KINDS.get(entry.kind, "FILE_TYPE_UNSPECIFIED"),
        "path": path,
        "size": str(entry.size),
        "mode": entry.mode & 0o7777,
        "permissions": stat_mod.filemode(TYPE_BITS.get(entry.kind, 0) | (entry.mode & 0o7777)),
        "owner": OWNERS.get(entry.uid, str(entry.uid)),
        "group": OWNERS.get(entry.gid, str(entry.gid)),
        "modifiedTime": mtime.isoformat().replace("+00:00", "Z"),
    }
    if entry.target:
        shown["symlinkTarget"] = entry.target
    return shown


async def stat(where: Target, body: dict[str, Any]) -> dict[str, Any]:
    path = where.path(body.get("path"))
    entry = await where.svc.files.stat(where.who, where.sandbox_id, path)
    return {"entry": entry_json(entry, path)}


async def list_dir(where: Target, body: dict[str, Any]) -> dict[str, Any]:
    """The entries `depth` levels down (1: the directory's own), as the files room walks
    them; past its bound on entries the listing is refused rather than cut short (the SDK
    has no way to say it was)."""
    root = where.path(body.get("path"))
    depth = max(int(body.get("depth") or 1), 1)
    walk = where.svc.files.walk(where.who, where.sandbox_id, root, depth=depth)
    entries = [entry_json(found.entry, found.path) async for found in walk]
    if walk.truncated:
        raise errors.PayloadTooLarge(
            f"{root} has more than {MAX_WALK_ENTRIES} entries to depth {depth}: list less deep"
        )
    return {"entries": entries}


async def make_dir(where: Target, body: dict[str, Any]) -> dict[str, Any]:
    path = where.path(body.get("path"))
    files = where.svc.files
    try:
        await files.stat(where.who, where.sandbox_id, path)
    except errors.NotFound:
        top = await first_missing(where, path)
        await files.mkdir(where.who, where.sandbox_id, path, mode=0o755, parents=True)
        await own(where, top)
        return await stat(where, {"path": path})
    raise errors.AlreadyExists(f"{path} already exists")


async def move(where: Target, body: dict[str, Any]) -> dict[str, Any]:
    source, dest = where.path(body.get("source")), where.path(body.get("destination"))
    entry = await where.svc.files.move(where.who, where.sandbox_id, source, dest, user=where.user)
    return {"entry": entry_json(entry, dest)}


async def remove(where: Target, body: dict[str, Any]) -> dict[str, Any]:
    path = where.path(body.get("path"))
    await where.svc.files.stat(where.who, where.sandbox_id, path)
    await where.svc.files.remove(where.who, where.sandbox_id, path, recursive=True)
    return {}


WATCHERS = Watchers()


async def new_watcher(where: Target, body: dict[str, Any]) -> Watcher:
    path, recursive = where.path(body.get("path")), bool(body.get("recursive"))
    svc = where.svc
    return await WATCHERS.create(
        svc.background, svc.files, where.who, where.sandbox_id, path, recursive
    )


async def create_watcher(where: Target, body: dict[str, Any]) -> dict[str, Any]:
    return {"watcherId": (await new_watcher(where, body)).id}


async def watcher_events(where: Target, body: dict[str, Any]) -> dict[str, Any]:
    return {"events": WATCHERS.take(where.sandbox_id, str(body.get("watcherId")))}


async def remove_watcher(where: Target, body: dict[str, Any]) -> dict[str, Any]:
    await WATCHERS.remove(where.sandbox_id, str(body.get("watcherId")))
    return {}


FILESYSTEM = {
    "Stat": stat,
    "ListDir": list_dir,
    "MakeDir": make_dir,
    "Move": move,
    "Remove": remove,
    "CreateWatcher": create_watcher,
    "GetWatcherEvents": watcher_events,
    "RemoveWatcher": remove_watcher,
}
