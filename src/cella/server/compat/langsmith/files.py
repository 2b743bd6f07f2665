"""The LangSmith data plane's files: upload, download (HEAD, ranges, ETags), glob (the
files room's walk) and grep, paths relative to the home directory."""

from __future__ import annotations

import posixpath
import re
import time
from collections.abc import AsyncIterator
from email.utils import formatdate
from typing import Annotated, Any

from fastapi import APIRouter, Body, File, Header, Request, Response, UploadFile
from fastapi.responses import StreamingResponse

from cella import errors
from cella.guest.protocol import Entry
from cella.models import ExecRequest, guest_path
from cella.policy.access import Permission, Principal
from cella.server.compat.langsmith.waking import awake
from cella.server.deps import Caller, DaemonDep
from cella.service.daemon import Daemon

Json = dict[str, Any]
JsonBody = Annotated[dict[str, Any], Body()]
Upload = Annotated[UploadFile, File()]
GLOB_LIMIT = 1000
GLOB_SECONDS = 10.0
HOME = "/root"


router = APIRouter(include_in_schema=False)


@router.post("/upload")
async def upload(sandbox_id: str, path: str, svc: DaemonDep, who: Caller, file: Upload) -> Json:
    await awake(svc, who, sandbox_id)
    target = absolute(path)

    async def chunks() -> AsyncIterator[bytes]:
        while chunk := await file.read(256 << 10):
            yield chunk

    entry = await svc.files.write(who, sandbox_id, target, chunks(), parents=True)
    return {"path": target, "size": entry.size}


@router.api_route("/download", methods=["GET", "HEAD"])
async def download(
    sandbox_id: str,
    path: str,
    request: Request,
    svc: DaemonDep,
    who: Caller,
    range_: str | None = Header(default=None, alias="range"),
    if_range: str | None = Header(default=None),
    if_none_match: str | None = Header(default=None),
) -> Response:
    await awake(svc, who, sandbox_id)
    target = absolute(path)
    entry = await svc.files.stat(who, sandbox_id, target)
    if entry.kind == "dir":
        raise errors.IsADirectory(f"{target} is a directory")
    etag = f'"{entry.size:x}-{entry.mtime_ns:x}"'
    headers = {
        "etag": etag,
        "last-modified": formatdate(entry.mtime_ns / 1e9, usegmt=True),
        "accept-ranges": "bytes",
        "content-type": "application/octet-stream",
    }
    if if_none_match and etag in if_none_match:
        return Response(status_code=304, headers=headers)
    span = None if (if_range and if_range != etag) else byte_range(range_, entry.size)
    if isinstance(span, str):  # unsatisfiable
        return Response(status_code=416, headers={"content-range": f"bytes */{entry.size}"})
    if request.method == "HEAD":
        return Response(headers={**headers, "content-length": str(entry.size)})
    if span is None:
        body = await svc.files.read(who, sandbox_id, target)
        return StreamingResponse(body, headers={**headers, "content-length": str(entry.size)})
    first, last = span
    headers["content-range"] = f"bytes {first}-{last}/{entry.size}"
    headers["content-length"] = str(last - first + 1)
    body = slice_of(svc, who, sandbox_id, target, first, last - first + 1)
    return StreamingResponse(body, status_code=206, headers=headers)


@router.post("/glob")
async def glob(sandbox_id: str, svc: DaemonDep, who: Caller, body: JsonBody) -> Json:
    await awake(svc, who, sandbox_id)
    root = absolute(str(body.get("path") or HOME))
    limit = min(int(body.get("limit") or GLOB_LIMIT), GLOB_LIMIT)
    matcher = glob_regex(str(body.get("pattern") or "*"))
    matches, truncated = await walk(svc, who, sandbox_id, root, matcher, limit)
    return {
        "matches": [
            {
                "path": full,
                "is_dir": e.kind == "dir",
                "size_bytes": e.size,
                "modified_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(e.mtime_ns / 1e9)),
            }
            for full, e in matches
        ],
        "truncated": truncated,
    }


@router.post("/grep")
async def grep(sandbox_id: str, svc: DaemonDep, who: Caller, body: JsonBody) -> Json:
    await awake(svc, who, sandbox_id)
    root = absolute(str(body.get("path") or HOME))
    limit = min(int(body.get("limit") or GLOB_LIMIT), GLOB_LIMIT)
    argv = ["grep", "-rnIF", "--", str(body.get("pattern") or ""), root]
    if body.get("glob") and "/" not in body["glob"] and "**" not in body["glob"]:
        argv[1:1] = [f"--include={body['glob']}"]
    request = ExecRequest(command=argv, timeout=60)
    result = await svc.exec.run(who, sandbox_id, request, exempt=True)
    matches = []
    for line in result.stdout.decode(errors="replace").splitlines():
        path, _, rest = line.partition(":")
        number, _, text = rest.partition(":")
        if number.isdigit():
            matches.append({"path": path, "line": int(number), "text": text})
    if body.get("glob") and ("/" in body["glob"] or "**" in body["glob"]):
        rx = glob_regex(body["glob"])
        matches = [m for m in matches if rx.match(posixpath.relpath(str(m["path"]), root))]
    return {"matches": matches[:limit], "truncated": len(matches) > limit}


def absolute(path: str) -> str:
    """The SDK resolves relative paths from the home directory."""
    try:
        return guest_path(path if path.startswith("/") else posixpath.join(HOME, path))
    except ValueError as exc:
        raise errors.InvalidArgument(str(exc)) from None


def byte_range(header: str | None, size: int) -> tuple[int, int] | str | None:
    """One `bytes=` range as (first, last) within `size`, "unsatisfiable", or None (none)."""
    m = re.fullmatch(r"\s*bytes=(\d*)-(\d*)\s*", header or "")
    if not m or (not m.group(1) and not m.group(2)):
        return None
    if not m.group(1):  # the last N bytes
        n = int(m.group(2))
        return (max(0, size - n), size - 1) if n and size else "unsatisfiable"
    first = int(m.group(1))
    if first >= size:
        return "unsatisfiable"
    last = min(int(m.group(2)), size - 1) if m.group(2) else size - 1
    return (first, last) if last >= first else "unsatisfiable"


async def slice_of(
    svc: Daemon, who: Principal, sandbox_id: str, path: str, offset: int, count: int
) -> AsyncIterator[bytes]:
    """`count` bytes of a file from `offset`, read in the guest (`dd`), streamed."""
    argv = ["dd", f"if={path}", "bs=64K", "iflag=skip_bytes,count_bytes",
            f"skip={offset}", f"count={count}", "status=none"]  # fmt: skip
    request = ExecRequest(command=argv)
    events = svc.exec.stream(who, sandbox_id, request, need=Permission.view, exempt=True)
    async for event in events:
        data = getattr(event, "data", None)
        if data and getattr(event, "stream", "") == "stdout":
            yield data


def glob_regex(pattern: str) -> re.Pattern[str]:
    """A glob against paths relative to the search root: `**` any number of segments,
    `*` and `?` within one, `[...]` a set."""
    out, i = "", 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif c == "*":
            out, i = out + "[^/]*", i + 1
        elif c == "?":
            out, i = out + "[^/]", i + 1
        elif c == "[" and (end := pattern.find("]", i + 1)) > i:
            body = pattern[i + 1 : end].replace("\\", "\\\\")
            out, i = out + "[" + ("^" + body[1:] if body.startswith("!") else body) + "]", end + 1
        else:
            out, i = out + re.escape(c), i + 1
    return re.compile(out + r"\Z")


async def walk(
    svc: Daemon, who: Principal, sandbox_id: str, root: str, rx: re.Pattern[str], limit: int
) -> tuple[list[tuple[str, Entry]], bool]:
    """Entries under `root` whose path relative to it matches, breadth first (the files
    room's walk, for GLOB_SECONDS at most), until `limit` matches or a bound of the walk."""
    recursive = "**" in rx.pattern or "/" in rx.pattern
    depth = None if recursive else 1
    found: list[tuple[str, Entry]] = []
    tree = svc.files.walk(who, sandbox_id, root, depth=depth, seconds=GLOB_SECONDS)
    async for item in tree:
        if rx.match(item.relative):
            found.append((item.path, item.entry))
            if len(found) >= limit:
                return found, True
    return found, tree.truncated
