"""envd's `process.Process`: commands run as cella processes that outlive their
connection (the `processes` room), as the user the SDK acts as, found again by guest pid or
tag; their output streams as Connect events, and input, signals and terminal sizes reach
them while they run."""

from __future__ import annotations

import base64
import binascii
import secrets
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response

from cella import errors
from cella.models import ExecRequest
from cella.server.compat.e2b import connect
from cella.server.compat.e2b.target import Target, target
from cella.service.processes import Process, ProcessSpec

PROCESS_KEEPALIVE: dict[str, Any] = {"event": {"keepalive": {}}}
SIGNALS = {"SIGNAL_SIGKILL": 9, "SIGNAL_SIGTERM": 15, 9: 9, 15: 15}


router = APIRouter(include_in_schema=False)


@router.post("/process.Process/{method}")
async def process(method: str, request: Request) -> Response:
    where = await target(request)
    return await connect.method_of(PROCESS, "process.Process", method)(where, request)


async def start(where: Target, request: Request) -> Response:
    body = await connect.read_first(request)
    config = body.get("process") or {}
    cmd = config.get("cmd")
    if not isinstance(cmd, str) or not cmd:
        raise errors.InvalidArgument("process.cmd is required")
    pty = body.get("pty")
    size = (pty or {}).get("size") or {}
    exec_request = ExecRequest(
        command=[cmd, *[str(a) for a in config.get("args") or []]],
        env={str(k): str(v) for k, v in (config.get("envs") or {}).items()},
        cwd=where.path(config.get("cwd") or where.home),
        user=where.user,
    )
    tag = body.get("tag")
    spec = ProcessSpec(
        request=exec_request,
        pty=(int(size.get("cols") or 80), int(size.get("rows") or 24)) if pty is not None else None,
        stdin=bool(body.get("stdin", pty is not None)),
        ttl=600.0,
    )
    proc_id = f"tag:{tag}" if tag else f"e2b-{secrets.token_hex(8)}"
    proc = await where.svc.processes.start(where.who, where.sandbox_id, proc_id, spec)
    return connect.stream(
        events(proc, live=False), PROCESS_KEEPALIVE, connect.keepalive_interval(request)
    )


async def attach(where: Target, request: Request) -> Response:
    body = await connect.read_first(request)
    proc = selected(where, body)
    return connect.stream(
        events(proc, live=True), PROCESS_KEEPALIVE, connect.keepalive_interval(request)
    )


async def events(proc: Process, live: bool) -> AsyncIterator[dict[str, Any]]:
    """start, then output (from now on when re-attaching), then end."""
    yield {"event": {"start": {"pid": proc.pid}}}
    offsets = {s: b.end for s, b in proc.buffers.items()} if live else None
    stream_of = "pty" if proc.spec.pty else None
    async with proc.attached():
        async for chunk in proc.follow(offsets):
            data = base64.b64encode(chunk.data).decode()
            yield {"event": {"data": {stream_of or chunk.stream: data}}}
    yield {"event": {"end": end_of(proc)}}


def end_of(proc: Process) -> dict[str, Any]:
    if proc.failure is not None:
        return {"exitCode": -1, "exited": False, "status": "error", "error": proc.failure.message}
    status = proc.status
    assert status is not None
    if status.signal:
        return {"exitCode": -1, "exited": False, "status": f"signal: {status.signal}"}
    code = status.exit_code or 0
    end: dict[str, Any] = {"exited": True, "status": f"exit status {code}"}
    if code:
        end["exitCode"] = code
    return end


def selected(where: Target, body: dict[str, Any]) -> Process:
    selector = body.get("process") or {}
    procs = where.svc.processes.list(where.who, where.sandbox_id)
    if "pid" in selector:
        found = [p for p in procs if p.pid == int(selector["pid"])]
    elif "tag" in selector:
        found = [p for p in procs if p.id == f"tag:{selector['tag']}"]
    else:
        raise errors.InvalidArgument("process: a pid or a tag is required")
    if not found:
        raise errors.NotFound(f"process {selector} not found")
    return found[-1]


async def list_processes(where: Target, request: Request) -> Response:
    await connect.read_unary(request)
    shown = []
    for proc in where.svc.processes.list(where.who, where.sandbox_id):
        if proc.done or proc.pid is None:
            continue
        command = proc.spec.request.command
        argv = command if isinstance(command, list) else ["/bin/sh", "-c", command]
        item: dict[str, Any] = {
            "config": {
                "cmd": argv[0],
                "args": argv[1:],
                "envs": proc.spec.request.env,
                "cwd": proc.spec.request.cwd,
            },
            "pid": proc.pid,
        }
        if proc.id.startswith("tag:"):
            item["tag"] = proc.id[4:]
        shown.append(item)
    return connect.unary({"processes": shown})


async def send_signal(where: Target, request: Request) -> Response:
    body = await connect.read_unary(request)
    signal = SIGNALS.get(body.get("signal", "SIGNAL_SIGKILL"))
    if signal is None:
        raise errors.InvalidArgument(f"signal {body.get('signal')!r} is not supported")
    proc = selected(where, body)
    if proc.done:
        raise errors.NotFound("the process has ended")
    await proc.kill(signal)
    return connect.unary({})


async def send_input(where: Target, request: Request) -> Response:
    body = await connect.read_unary(request)
    await selected(where, body).write(input_bytes(body.get("input") or {}))
    return connect.unary({})


async def stream_input(where: Target, request: Request) -> Response:
    proc: Process | None = None
    async for message in connect.read_stream(request):
        if "start" in message:
            proc = selected(where, message["start"])
        elif "data" in message:
            if proc is None:
                raise errors.InvalidArgument("input before the start message")
            await proc.write(input_bytes(message["data"].get("input") or {}))

    async def done() -> AsyncIterator[dict[str, Any]]:
        yield {}

    return connect.stream(done(), {}, 60.0)


async def close_stdin(where: Target, request: Request) -> Response:
    await selected(where, await connect.read_unary(request)).close_stdin()
    return connect.unary({})


async def update(where: Target, request: Request) -> Response:
    body = await connect.read_unary(request)
    size = ((body.get("pty") or {}).get("size")) or {}
    proc = selected(where, body)
    if size:
        await proc.resize(int(size.get("cols") or 80), int(size.get("rows") or 24))
    return connect.unary({})


def input_bytes(given: dict[str, Any]) -> bytes:
    data = given.get("stdin", given.get("pty"))
    if not isinstance(data, str):
        raise errors.InvalidArgument("input: stdin or pty bytes are required")
    try:
        return base64.b64decode(data + "=" * (-len(data) % 4))
    except binascii.Error:
        raise errors.InvalidArgument("input is not base64") from None


PROCESS = {
    "Start": start,
    "Connect": attach,
    "List": list_processes,
    "SendSignal": send_signal,
    "SendInput": send_input,
    "StreamInput": stream_input,
    "CloseStdin": close_stdin,
    "Update": update,
}
