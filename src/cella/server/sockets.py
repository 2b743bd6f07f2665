"""The start every WebSocket route shares: authenticate the caller and find what the socket
is for (a sandbox, a guest port, a process, a node), then accept; a refusal closes the
socket with 4000 + the error's HTTP status and its message as the reason.

Closed before it is accepted, a socket is a refused handshake (HTTP 403, whatever the
code). A browser's page learns nothing from that, so the console's sockets are accepted
first and then closed (`accept_refusal`), and the page reads the code and the reason."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

from fastapi import WebSocket

from cella import errors
from cella.server.deps import api_key_caller, principal
from cella.service.keys import Principal

T = TypeVar("T")


def bearer(ws: WebSocket, tenant: str | None = None) -> Principal:
    """The caller of a socket by `Authorization: Bearer` (or the console's session)."""
    return principal(ws, ws.headers.get("authorization"), tenant)


def api_key(ws: WebSocket) -> Principal:
    """The caller of a foreign API's socket, by `X-Api-Key` (LangSmith's)."""
    return api_key_caller(ws, ws.headers.get("x-api-key"), ws.headers.get("x-cella-tenant"))


async def opened(
    ws: WebSocket,
    setup: Callable[[], Awaitable[T]],
    *,
    accept: bool = True,
    accept_refusal: bool = False,
) -> T | None:
    """What `setup` finds, the socket then accepted (unless `accept` is false: a relay
    accepts once the other end has); None when it refused, the socket closed."""
    try:
        found = await setup()
    except errors.CellaError as exc:
        if accept_refusal:
            await ws.accept()
        code = 4000 + (exc.status if exc.status < 1000 else 500)
        await ws.close(code=code, reason=exc.message[:120])
        return None
    if accept:
        await ws.accept()
    return found
