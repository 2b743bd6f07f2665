"""The Connect protocol with the JSON codec, as E2B's envd speaks it: unary calls are JSON in
and out; streams are 5-byte envelopes (flags, big-endian length) ending with an end-stream
envelope (flag 2) that carries `{}` or the error. Errors are `{code, message}` with Connect's
code names and their HTTP statuses."""

from __future__ import annotations

import asyncio
import contextlib
import json
import struct
from collections.abc import AsyncIterable, AsyncIterator, Mapping
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from cella import errors

STREAM_TYPE = "application/connect+json"  # exactly: the SDK refuses any parameter
END_STREAM = 0x02
MAX_MESSAGE = 16 << 20
Handler = TypeVar("Handler")
# cella's error codes as Connect's, with the HTTP status Connect gives each
CODES: dict[str, str] = {
    "not_found": "not_found",
    "invalid_argument": "invalid_argument",
    "unknown_user": "invalid_argument",
    "unauthenticated": "unauthenticated",
    "permission_denied": "permission_denied",
    "already_exists": "already_exists",
    "payload_too_large": "resource_exhausted",
    "quota_exceeded": "resource_exhausted",
    "is_a_directory": "invalid_argument",
    "not_a_directory": "invalid_argument",
    "directory_not_empty": "failed_precondition",
    "invalid_state": "failed_precondition",
    "timeout": "deadline_exceeded",
    "no_space": "resource_exhausted",
}
STATUS = {
    "invalid_argument": 400,
    "failed_precondition": 400,
    "unauthenticated": 401,
    "permission_denied": 403,
    "not_found": 404,
    "already_exists": 409,
    "resource_exhausted": 429,
    "deadline_exceeded": 504,
    "unavailable": 503,
    "unimplemented": 501,
    "internal": 500,
}


def method_of(table: Mapping[str, Handler], service: str, method: str) -> Handler:
    """The handler of an RPC method of `service`, or a refusal that names it."""
    handler = table.get(method)
    if handler is None:
        raise errors.InvalidArgument(f"not supported by cella: {service}/{method}")
    return handler


def connect_error(exc: errors.CellaError) -> tuple[int, dict[str, str]]:
    code = CODES.get(exc.code, "internal" if exc.status >= 500 else "invalid_argument")
    if isinstance(exc, errors.SandboxError):
        code = "unavailable"
    return STATUS[code], {"code": code, "message": exc.message}


async def read_unary(request: Request) -> dict[str, Any]:
    body = await request.body()
    if len(body) > MAX_MESSAGE:
        raise errors.PayloadTooLarge("the message is too large")
    return _object(body or b"{}")


async def read_stream(request: Request) -> AsyncIterator[dict[str, Any]]:
    """The messages of a streamed request body, one envelope each."""
    pending = b""
    async for chunk in request.stream():
        pending += chunk
        while len(pending) >= 5:
            flags, size = struct.unpack(">BI", pending[:5])
            if size > MAX_MESSAGE:
                raise errors.PayloadTooLarge("the message is too large")
            if len(pending) < 5 + size:
                break
            payload, pending = pending[5 : 5 + size], pending[5 + size :]
            if flags & 0x01:
                raise errors.InvalidArgument("compressed messages are not accepted")
            if not flags & END_STREAM:
                yield _object(payload)
    if pending:
        raise errors.InvalidArgument("the stream ended inside a message")


async def read_first(request: Request) -> dict[str, Any]:
    """The one message of a server-streaming call's request."""
    async for message in read_stream(request):
        return message
    return {}


def unary(message: dict[str, Any]) -> Response:
    return JSONResponse(message)


def envelope(message: dict[str, Any], flags: int = 0) -> bytes:
    payload = json.dumps(message, separators=(",", ":")).encode()
    return struct.pack(">BI", flags, len(payload)) + payload


def stream(
    messages: AsyncIterable[dict[str, Any]], keepalive: dict[str, Any], every: float
) -> StreamingResponse:
    """A server stream: the messages, a keepalive after `every` quiet seconds, and the
    end-stream envelope (with the error, if the messages failed with one)."""

    async def body() -> AsyncIterator[bytes]:
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue(maxsize=16)

        async def pump() -> None:
            try:
                async for message in messages:
                    await queue.put(("message", message))
                await queue.put(("end", None))
            except errors.CellaError as exc:
                await queue.put(("error", exc))

        task = asyncio.create_task(pump())
        try:
            while True:
                try:
                    kind, item = await asyncio.wait_for(queue.get(), every)
                except TimeoutError:
                    yield envelope(keepalive)
                    continue
                if kind == "message":
                    yield envelope(item)
                elif kind == "end":
                    yield envelope({}, END_STREAM)
                    return
                else:
                    yield envelope({"error": connect_error(item)[1]}, END_STREAM)
                    return
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, errors.CellaError):
                await task

    return StreamingResponse(body(), media_type=STREAM_TYPE)


def keepalive_interval(request: Request, default: float = 30.0) -> float:
    """What the client asks for (`Keepalive-Ping-Interval`, seconds), within reason."""
    try:
        wanted = float(request.headers.get("keepalive-ping-interval") or default)
    except ValueError:
        wanted = default
    return min(max(wanted, 1.0), 300.0)


def _object(payload: bytes) -> dict[str, Any]:
    try:
        value = json.loads(payload)
    except ValueError:
        raise errors.InvalidArgument("the message is not JSON") from None
    if not isinstance(value, dict):
        raise errors.InvalidArgument("the message must be a JSON object")
    return value
