"""A terminal in a sandbox over a WebSocket: a login shell on a real PTY in the guest.

Binary messages carry bytes both ways (keystrokes in, the terminal's output out; Ctrl-C is
the byte 0x03, which the guest's line discipline turns into SIGINT). Text messages carry
JSON control: `{"type": "resize", "cols": C, "rows": R}` from the client, and
`{"type": "exit", "exit_code": N}` (or `{"type": "error", ...}`) from the server before it
closes. The shell is killed when the WebSocket goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
from typing import Any

from fastapi import APIRouter, WebSocket, WebSocketDisconnect

from cella import errors
from cella.models import ExecRequest
from cella.server.deps import daemon
from cella.server.sockets import bearer, opened
from cella.service.processes import Process, ProcessSpec

router = APIRouter(tags=["sandboxes"])
SHELL = "command -v bash >/dev/null && exec bash -l; exec sh -l"
TERM_ENV = {"TERM": "xterm-256color", "LANG": "C.UTF-8", "COLORTERM": "truecolor"}
MAX_SIZE = 1000


@router.websocket("/v1/sandboxes/{sandbox_id}/terminal")
async def terminal(
    ws: WebSocket,
    sandbox_id: str,
    cols: int = 80,
    rows: int = 24,
    tenant: str | None = None,
) -> None:
    """`tenant`: an admin key acting for that tenant (a browser cannot set headers on a
    WebSocket); a refusal is a close with code 4000 + the HTTP status, and its reason."""

    async def shell() -> Process:
        who = bearer(ws, tenant)
        if not (1 <= cols <= MAX_SIZE and 1 <= rows <= MAX_SIZE):
            raise errors.InvalidArgument(f"cols and rows must be 1-{MAX_SIZE}")
        spec = ProcessSpec(
            request=ExecRequest(command=["/bin/sh", "-c", SHELL], env=TERM_ENV),
            pty=(cols, rows),
            stdin=True,
            kill_on_disconnect=True,
            ttl=10.0,
        )
        name = f"terminal-{secrets.token_hex(6)}"
        return await daemon(ws).processes.start(who, sandbox_id, name, spec)

    proc = await opened(ws, shell, accept_refusal=True)  # a browser reads the reason
    if proc is None:
        return
    async with proc.attached():
        await _relay(ws, proc)


async def _relay(ws: WebSocket, proc: Process) -> None:
    async def keys() -> None:
        while True:
            msg = await ws.receive()
            if msg["type"] == "websocket.disconnect":
                return
            if data := msg.get("bytes"):
                await proc.write(data)
            elif text := msg.get("text"):
                await _control(proc, text)

    async def screen() -> None:
        async for chunk in proc.follow():
            await ws.send_bytes(chunk.data)
        await ws.send_text(json.dumps(_outcome(proc)))
        with contextlib.suppress(RuntimeError):
            await ws.close()

    tasks = [asyncio.ensure_future(keys()), asyncio.ensure_future(screen())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    except WebSocketDisconnect:
        pass
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _control(proc: Process, text: str) -> None:
    try:
        msg: Any = json.loads(text)
        if msg.get("type") == "resize":
            cols, rows = int(msg["cols"]), int(msg["rows"])
            if 1 <= cols <= MAX_SIZE and 1 <= rows <= MAX_SIZE:
                await proc.resize(cols, rows)
    except (ValueError, KeyError, TypeError, AttributeError):
        pass  # a malformed control message changes nothing


def _outcome(proc: Process) -> dict[str, Any]:
    if proc.failure is not None:
        return {"type": "error", "code": proc.failure.code, "message": proc.failure.message}
    status = proc.status
    return {
        "type": "exit",
        "exit_code": status.exit_code if status else None,
        "signal": status.signal if status else None,
    }
