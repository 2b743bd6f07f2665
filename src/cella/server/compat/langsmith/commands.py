"""The LangSmith data plane's commands: cella processes (they survive a dropped
connection), started and re-attached by command id from byte offsets, over a WebSocket
(input, close-stdin and kill while output streams) or as server-sent events."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import math
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Body, WebSocket
from fastapi.responses import StreamingResponse
from pydantic import ValidationError
from starlette.websockets import WebSocketDisconnect, WebSocketState

from cella import errors
from cella.models import ExecRequest
from cella.policy.access import Permission
from cella.server.compat.langsmith import buildkit
from cella.server.compat.langsmith.shapes import ERRORS
from cella.server.compat.langsmith.waking import awake
from cella.server.deps import Caller, DaemonDep, daemon
from cella.server.error_shapes import describe
from cella.server.sockets import api_key, opened
from cella.service.daemon import Daemon
from cella.service.keys import Principal
from cella.service.processes import Process, ProcessSpec

Json = dict[str, Any]
JsonBody = Annotated[dict[str, Any], Body()]
WS_CHUNK = 256 << 10  # the SDK accepts WebSocket messages up to 1 MiB
TERMINAL = (120, 40)  # the SDK sends no size; a terminal needs one


router = APIRouter(include_in_schema=False)


@router.websocket("/execute/ws")
async def execute_ws(ws: WebSocket, sandbox_id: str) -> None:
    await serve_execute(ws, sandbox_id)


@router.post("/execute/stream/start")
async def execute_start(
    sandbox_id: str, svc: DaemonDep, who: Caller, body: JsonBody
) -> StreamingResponse:
    await awake(svc, who, sandbox_id)
    proc = await start_process(svc, who, sandbox_id, {**body, "close_stdin": True})
    return StreamingResponse(sse(proc, 0, 0), media_type="text/event-stream")


@router.post("/execute/stream/resume")
async def execute_resume(
    sandbox_id: str, svc: DaemonDep, who: Caller, body: JsonBody
) -> StreamingResponse:
    proc = svc.processes.get(who, sandbox_id, str(body.get("command_id")), Permission.exec)
    out, err = int(body.get("stdout_offset") or 0), int(body.get("stderr_offset") or 0)
    return StreamingResponse(sse(proc, out, err), media_type="text/event-stream")


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


async def start_process(svc: Daemon, who: Principal, sandbox_id: str, msg: Json) -> Process:
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
    await buildkit.check(svc, who, sandbox_id, str(msg.get("command") or ""))
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
    return await svc.processes.start(who, sandbox_id, command_id, spec)


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

    async def caller() -> Principal:
        who = api_key(ws)
        svc.registry.get(who, sandbox_id, Permission.exec)  # refused before it opens
        return who

    who = await opened(ws, caller)
    if who is None:
        return
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
                proc = await start_process(svc, who, sandbox_id, msg)
            elif kind == "reconnect":
                command_id = str(msg.get("command_id"))
                try:
                    proc = svc.processes.get(who, sandbox_id, command_id, Permission.exec)
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
