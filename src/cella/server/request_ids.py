"""Gives every HTTP request an id (the caller's `X-Request-Id` when it is a sane one, else a
new one), answers it in `X-Request-Id`, and marks the request as the one being served, so
log lines written while serving it carry it (`cella.telemetry.logs`)."""

from __future__ import annotations

import re
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cella.telemetry.logs import REQUEST_ID, serving

SANE = re.compile(r"[A-Za-z0-9._:-]{1,128}")


class RequestIds:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or []).get(b"x-request-id", b"").decode("latin-1")
        request_id = given if SANE.fullmatch(given) else uuid.uuid4().hex
        scope[REQUEST_ID] = request_id

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers") or [])
                headers.append((b"x-request-id", request_id.encode()))
                message = {**message, "headers": headers}
            await send(message)

        token = serving.set(scope)
        try:
            await self.app(scope, receive, sending)
        finally:
            serving.reset(token)
