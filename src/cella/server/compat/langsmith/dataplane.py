"""The LangSmith data plane, one per sandbox at its `dataplane_url`
(`/api/v2/sandboxes/dataplane/{sandbox id}`): files (upload, download with ranges, glob,
grep), commands over a WebSocket or SSE (processes that survive a dropped connection and
are re-attached by id from byte offsets) and TCP tunnels (yamux over a WebSocket). A
request to a stopped or paused sandbox resumes it, as the SDK expects (not with a read-only
key: waking is a write)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import math
import posixpath
import re
import time
from collections.abc import AsyncIterator
from email.utils import formatdate
from typing import Annotated, Any

from fastapi import APIRouter, Body, File, Header, Request, Response, UploadFile, WebSocket
from fastapi.responses import StreamingResponse
from pydantic import ValidationError
from starlette.websockets import WebSocketDisconnect, WebSocketState

from cella import errors
from cella.guest.protocol import Entry
from cella.models import ExecRequest, SandboxState, guest_path
from cella.server.app import describe
from cella.server.compat.langsmith.shapes import DATAPLANE, ERRORS
from cella.server.compat.langsmith.yamux import YamuxSession, YamuxStream
from cella.server.deps import Caller, Service, api_key_caller, daemon
from cella.service.daemon import Daemon
from cella.service.keys import Principal
from cella.service.processes import Process, ProcessSpec
from cella.store import SandboxRecord

Json = dict[str, Any]
JsonBody = Annotated[dict[str, Any], Body()]
Upload = Annotated[UploadFile, File()]
S = SandboxState
WS_CHUNK = 256 << 10  # the SDK accepts WebSocket messages up to 1 MiB
GLOB_LIMIT = 1000
GLOB_SECONDS = 10.0
TERMINAL = (120, 40)  # the SDK sends no size; a terminal needs one
HOME = "/root"


def router() -> APIRouter:
    api = APIRouter(prefix=DATAPLANE + "/{sandbox_id}", include_in_schema=False)

    @api.post("/upload")
    async def upload(sandbox_id: str, path: str, svc: Service, who: Caller, file: Upload) -> Json:
        await awake(svc, who, sandbox_id)
        target = absolute(path)

        async def chunks() -> AsyncIterator[bytes]:
            while chunk := await file.read(256 << 10):
                yield chunk

        entry = await svc.files.write(who.tenant, sandbox_id, target, chunks(), parents=True)
        return {"path": target, "size": entry.size}

    @api.api_route("/download", methods=["GET", "HEAD"])
    async def download(
        sandbox_id: str,
        path: str,
        request: Request,
        svc: Service,
        who: Caller,
        range_: str | None = Header(default=None, alias="range"),
        if_range: str | None = Header(default=None),
        if_none_match: str | None = Header(default=None),
    ) -> Response:
        await awake(svc, who, sandbox_id)
        target = absolute(path)
        entry = await svc.files.stat(who.tenant, sandbox_id, target)
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
            body = await svc.files.read(who.tenant, sandbox_id, target)
            return StreamingResponse(body, headers={**headers, "content-length": str(entry.size)})
        first, last = span
        headers["content-range"] = f"bytes {first}-{last}/{entry.size}"
        headers["content-length"] = str(last - first + 1)
        body = slice_of(svc, who.tenant, sandbox_id, target, first, last - first + 1)
        return StreamingResponse(body, status_code=206, headers=headers)

    @api.post("/glob")
    async def glob(sandbox_id: str, svc: Service, who: Caller, body: JsonBody) -> Json:
        await awake(svc, who, sandbox_id)
        root = absolute(str(body.get("path") or HOME))
        limit = min(int(body.get("limit") or GLOB_LIMIT), GLOB_LIMIT)
        matcher = glob_regex(str(body.get("pattern") or "*"))
        matches, truncated = await walk(svc, who.tenant, sandbox_id, root, matcher, limit)
        return {
            "matches": [
                {
                    "path": full,
                    "is_dir": e.kind == "dir",
                    "size_bytes": e.size,
                    "modified_at": time.strftime(
                        "%Y-%m-%dT%H:%M:%SZ", time.gmtime(e.mtime_ns / 1e9)
                    ),
                }
                for full, e in matches
            ],
            "truncated": truncated,
        }

    @api.post("/grep")
    async def grep(sandbox_id: str, svc: Service, who: Caller, body: JsonBody) -> Json:
        await awake(svc, who, sandbox_id)
        root = absolute(str(body.get("path") or HOME))
        limit = min(int(body.get("limit") or GLOB_LIMIT), GLOB_LIMIT)
        argv = ["grep", "-rnIF", "--", str(body.get("pattern") or ""), root]
        if body.get("glob") and "/" not in body["glob"] and "**" not in body["glob"]:
            argv[1:1] = [f"--include={body['glob']}"]
        result = await svc.exec.run(who.tenant, sandbox_id, ExecRequest(command=argv, timeout=60))
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

    @api.websocket("/execute/ws")
    async def execute_ws(ws: WebSocket, sandbox_id: str) -> None:
        await serve_execute(ws, sandbox_id)

    @api.post("/execute/stream/start")
    async def execute_start(
        sandbox_id: str, svc: Service, who: Caller, body: JsonBody
    ) -> StreamingResponse:
        await awake(svc, who, sandbox_id)
        proc = await start_process(svc, who.tenant, sandbox_id, {**body, "close_stdin": True})
        return StreamingResponse(sse(proc, 0, 0), media_type="text/event-stream")

    @api.post("/execute/stream/resume")
    async def execute_resume(
        sandbox_id: str, svc: Service, who: Caller, body: JsonBody
    ) -> StreamingResponse:
        proc = svc.processes.get(who.tenant, sandbox_id, str(body.get("command_id")))
        out, err = int(body.get("stdout_offset") or 0), int(body.get("stderr_offset") or 0)
        return StreamingResponse(sse(proc, out, err), media_type="text/event-stream")

    @api.websocket("/tunnel")
    async def tunnel(ws: WebSocket, sandbox_id: str) -> None:
        await serve_tunnel(ws, sandbox_id)

    return api


# -- helpers ---------------------------------------------------------------------------------


async def awake(svc: Daemon, who: Principal, sandbox_id: str) -> SandboxRecord:
    """The sandbox, running: a stopped or paused one is resumed first. Waking is a write
    (it commits RAM and a quota slot), so a read-only key is refused and it sleeps on."""
    row = svc.registry.get(who.tenant, sandbox_id)
    if row.state in (S.stopped, S.paused, S.stopping):
        if who.read_only:
            raise errors.PermissionDenied(
                f"this key is read-only: sandbox {sandbox_id} is {row.state}, and resuming "
                "it is a write"
            )
        row = await svc.lifecycle.resume(who.tenant, sandbox_id)
    elif row.state in (S.creating, S.starting):
        for _ in range(600):
            await asyncio.sleep(0.1)
            row = svc.registry.get(who.tenant, sandbox_id)
            if row.state not in (S.creating, S.starting):
                break
    return row


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
    svc: Daemon, tenant: str, sandbox_id: str, path: str, offset: int, count: int
) -> AsyncIterator[bytes]:
    """`count` bytes of a file from `offset`, read in the guest (`dd`), streamed."""
    argv = ["dd", f"if={path}", "bs=64K", "iflag=skip_bytes,count_bytes",
            f"skip={offset}", f"count={count}", "status=none"]  # fmt: skip
    async for event in svc.exec.stream(tenant, sandbox_id, ExecRequest(command=argv)):
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
    svc: Daemon, tenant: str, sandbox_id: str, root: str, rx: re.Pattern[str], limit: int
) -> tuple[list[tuple[str, Entry]], bool]:
    """Entries under `root` whose path relative to it matches, breadth first, until `limit`
    matches or the deadline."""
    deadline = time.monotonic() + GLOB_SECONDS
    found: list[tuple[str, Entry]] = []
    queue = [root]
    recursive = "**" in rx.pattern or "/" in rx.pattern
    while queue:
        directory = queue.pop(0)
        try:
            entries = await svc.files.list(tenant, sandbox_id, directory)
        except errors.NotFound:
            if directory == root:
                raise
            continue
        except errors.PermissionDenied:
            continue
        for e in entries:
            full = posixpath.join(directory, e.name)
            if rx.match(posixpath.relpath(full, root)):
                found.append((full, e))
                if len(found) >= limit:
                    return found, True
            if e.kind == "dir" and recursive:
                queue.append(full)
        if time.monotonic() > deadline:
            return found, True
    return found, False


# -- commands ------------------------------------------------------------------------------


def seconds_or_none(msg: Json, field: str, default: float | None) -> float | None:
    """LangSmith's seconds: absent is `default`, negative (-1) is "no limit" (None; a
    session's TTL is then the daemon's longest, `max_process_keep_seconds`)."""
    value = msg.get(field)
    if value is None:
        return default
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise errors.InvalidArgument(f"{field} must be a number of seconds") from None
    if math.isnan(number):
        raise errors.InvalidArgument(f"{field} must be a number of seconds")
    return None if number < 0 or math.isinf(number) else number


async def start_process(svc: Daemon, tenant: str, sandbox_id: str, msg: Json) -> Process:
    """A LangSmith execute as a cella process (get-or-create on its command id)."""
    if msg.get("run_config") and (msg.get("env") or msg.get("cwd")):
        raise errors.InvalidArgument("env/cwd cannot be combined with run_config")
    config = msg.get("run_config") or {}
    shell = str(msg.get("shell") or "/bin/bash")
    try:
        request = ExecRequest(
            command=[shell, "-c", str(msg.get("command") or "")],
            cwd=msg.get("cwd") or config.get("work_dir"),
            env={**(msg.get("env") or {}), **(config.get("env_vars") or {})},
            user=config.get("user"),
            timeout=seconds_or_none(msg, "timeout_seconds", None) or None,  # 0: none
        )
    except (ValidationError, TypeError) as exc:
        problems = exc.errors() if isinstance(exc, ValidationError) else [{"msg": str(exc)}]
        raise errors.InvalidArgument(describe(problems)) from None
    pty = bool(msg.get("pty"))
    spec = ProcessSpec(
        request=request,
        pty=TERMINAL if pty else None,
        stdin=pty or not msg.get("close_stdin", False),  # the SDK says when to close it
        idle_timeout=seconds_or_none(msg, "idle_timeout_seconds", 300),
        kill_on_disconnect=bool(msg.get("kill_on_disconnect")),
        ttl=seconds_or_none(msg, "ttl_seconds", 600),
    )
    command_id = str(msg.get("command_id") or "") or f"cmd-{time.time_ns():x}"
    return await svc.processes.start(tenant, sandbox_id, command_id, spec)


class TextCursor:
    """Raw output bytes as text whose UTF-8 length equals the bytes it stands for (so the
    SDK's offsets stay exact): bytes that are not UTF-8 become '?', one each; a character
    cut by a chunk boundary waits for the rest."""

    @staticmethod
    def text(data: bytes, final: bool) -> tuple[str, int]:
        out, i = [], 0
        while i < len(data):
            try:
                out.append(data[i:].decode("utf-8"))
                return "".join(out), len(data)
            except UnicodeDecodeError as exc:
                out.append(data[i : i + exc.start].decode("utf-8"))
                bad_at = i + exc.start
                if exc.reason == "unexpected end of data" and not final:
                    return "".join(out), bad_at
                out.append("?" * (exc.end - exc.start))
                i = i + exc.end
        return "".join(out), len(data)


def outcome(proc: Process) -> Json:
    if proc.failure is not None:
        return {"type": "error", "error_type": "CommandError", "error": proc.failure.message}
    assert proc.status is not None
    if proc.status.timed_out:
        timeout = proc.spec.request.timeout
        return {"type": "error", "error_type": "CommandTimeout",
                "error": f"command timed out after {timeout:g}s"}  # fmt: skip
    return {"type": "exit", "exit_code": proc.status.exit_code}


async def serve_execute(ws: WebSocket, sandbox_id: str) -> None:
    svc = daemon(ws)
    try:
        who = api_key_caller(ws, ws.headers.get("x-api-key"), ws.headers.get("x-cella-tenant"))
        svc.registry.get(who.tenant, sandbox_id)
    except errors.CellaError as exc:
        await ws.close(code=4000 + (exc.status if exc.status < 1000 else 500))
        return
    await ws.accept()
    pending_close_stdin = False
    proc: Process | None = None
    offsets = {"stdout": 0, "stderr": 0}
    try:
        while proc is None:
            msg = json.loads(await ws.receive_text())
            kind = msg.get("type")
            if kind == "close_stdin":  # may come before `reconnect` (the SDK queues it)
                pending_close_stdin = True
            elif kind == "execute":
                await awake(svc, who, sandbox_id)
                proc = await start_process(svc, who.tenant, sandbox_id, msg)
            elif kind == "reconnect":
                command_id = str(msg.get("command_id"))
                try:
                    proc = svc.processes.get(who.tenant, sandbox_id, command_id)
                except errors.NotFound:
                    await send(ws, {"type": "error", "error_type": "CommandNotFound",
                                    "error": f"no command {command_id}"})  # fmt: skip
                    return
                offsets = {
                    "stdout": int(msg.get("stdout_offset") or 0),
                    "stderr": int(msg.get("stderr_offset") or 0),
                }
        if pending_close_stdin:
            await proc.close_stdin()
        await send(ws, {"type": "started", "command_id": proc.id, "pid": proc.pid})
        async with proc.attached():
            listener = asyncio.ensure_future(listen(ws, proc))
            try:
                await stream_output(ws, proc, offsets)
                await send(ws, outcome(proc))
            finally:
                listener.cancel()
        if ws.client_state is WebSocketState.CONNECTED:
            await ws.close(code=1000)
    except (WebSocketDisconnect, RuntimeError):
        return  # the client left; the process goes on (unless it asked otherwise)
    except errors.CellaError as exc:
        with contextlib.suppress(Exception):
            kind = ERRORS.get(exc.code, (0, "CommandError"))[1]  # e.g. QuotaExceeded
            await send(ws, {"type": "error", "error_type": kind, "error": exc.message})
            await ws.close(code=1000)


async def listen(ws: WebSocket, proc: Process) -> None:
    """The client's input, close-stdin and kill, while output streams."""
    with contextlib.suppress(WebSocketDisconnect, RuntimeError):
        while True:
            msg = json.loads(await ws.receive_text())
            kind = msg.get("type")
            if kind == "input":
                with contextlib.suppress(errors.CellaError):
                    await proc.write(str(msg.get("data") or "").encode())
            elif kind == "close_stdin":
                await proc.close_stdin()
            elif kind == "kill":
                await proc.kill(9)


async def stream_output(ws: WebSocket, proc: Process, offsets: dict[str, int]) -> None:
    held = {"stdout": b"", "stderr": b""}
    async for chunk in proc.follow(offsets):
        data = held[chunk.stream] + chunk.data
        start = chunk.offset - len(held[chunk.stream])
        text, used = TextCursor.text(data, final=False)
        held[chunk.stream] = data[used:]
        for piece, at in split_text(text, start):
            await send(ws, {"type": chunk.stream, "data": piece, "offset": at})
    for stream, rest in held.items():
        if rest:
            text, _ = TextCursor.text(rest, final=True)
            await send(ws, {"type": stream, "data": text,
                            "offset": proc.buffers[stream].end - len(rest)})  # fmt: skip


def split_text(text: str, offset: int) -> list[tuple[str, int]]:
    """Pieces under the SDK's message size, each with its byte offset."""
    pieces, at = [], offset
    while text:
        piece = text[:WS_CHUNK]
        pieces.append((piece, at))
        at += len(piece.encode())
        text = text[WS_CHUNK:]
    return pieces


async def send(ws: WebSocket, msg: Json) -> None:
    await ws.send_text(json.dumps(msg))


async def sse(proc: Process, stdout_offset: int, stderr_offset: int) -> AsyncIterator[bytes]:
    """The SSE form: base64 output with offsets, stream ends, exit; comments keep it alive."""

    def event(name: str, data: Json) -> bytes:
        return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()

    yield event("started", {"command_id": proc.id, "pid": proc.pid})
    follow = proc.follow({"stdout": stdout_offset, "stderr": stderr_offset})
    pending = asyncio.ensure_future(anext(follow, None))
    while True:
        done, _ = await asyncio.wait({pending}, timeout=15.0)
        if not done:
            yield b": ping\n\n"
            continue
        chunk = pending.result()
        if chunk is None:
            break
        for i in range(0, len(chunk.data), WS_CHUNK):
            part = chunk.data[i : i + WS_CHUNK]
            data = {"offset": chunk.offset + i, "data": base64.b64encode(part).decode()}
            yield event(chunk.stream, data)
        pending = asyncio.ensure_future(anext(follow, None))
    for stream in ("stdout", "stderr"):
        yield event("stream_end", {"stream": stream, "offset": proc.buffers[stream].end})
    result = outcome(proc)
    if result["type"] == "exit":
        yield event("exit", {"exit_code": result["exit_code"]})
    else:
        yield event("error", {"error_type": result["error_type"], "error": result["error"]})


# -- tunnels -------------------------------------------------------------------------------

TUNNEL_OK, TUNNEL_DIAL_FAILED, TUNNEL_BAD_VERSION = b"\x00", b"\x02", b"\x03"


async def serve_tunnel(ws: WebSocket, sandbox_id: str) -> None:
    svc = daemon(ws)
    try:
        who = api_key_caller(ws, ws.headers.get("x-api-key"), ws.headers.get("x-cella-tenant"))
        await awake(svc, who, sandbox_id)
    except errors.CellaError as exc:
        await ws.close(code=4000 + (exc.status if exc.status < 1000 else 500))
        return
    await ws.accept()

    async def carry(stream: YamuxStream) -> None:
        head = b""
        while len(head) < 3:
            more = await stream.read()
            if not more:
                return
            head += more
        version, port, rest = head[0], int.from_bytes(head[1:3], "big"), head[3:]
        if version != 1:
            await stream.write(TUNNEL_BAD_VERSION)
            return
        try:
            guest = await svc.ports.open(who.tenant, sandbox_id, port)
        except errors.CellaError:
            await stream.write(TUNNEL_DIAL_FAILED)
            return
        await stream.write(TUNNEL_OK)

        async def up() -> None:
            if rest:
                await guest.write(rest)
            while data := await stream.read():
                await guest.write(data)
            await guest.write_eof()

        async def down() -> None:
            while data := await guest.read():
                await stream.write(data)
            await stream.close_write()

        try:
            await asyncio.gather(up(), down())
        except (ConnectionError, errors.CellaError):
            await stream.reset()
        finally:
            await guest.close()

    session = YamuxSession(ws.send_bytes, carry)
    try:
        while not session.closed:
            message = await ws.receive()
            if message["type"] == "websocket.disconnect":
                break
            data = message.get("bytes") or (message.get("text") or "").encode()
            await session.feed(data)
    except (WebSocketDisconnect, RuntimeError):
        pass
    finally:
        await session.close()
