"""The audit log of key use: every request that presented a valid API key (refused ones
included) as key id, tenant, method, path, status and client address, in the database
(`key_uses`, the newest `audit_keep` entries). Paths only: no query strings, bodies or
headers, so nothing a request carries (file contents, secret values) is logged."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cella.server.front import Front
from cella.service.keys import Principal


class AuditKeyUse:
    def __init__(self, app: ASGIApp, keep: int) -> None:
        self.app = app
        self.keep = keep

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        status = {"code": 500}
        scope.setdefault("state", {})  # shared with the request, whatever copies the scope

        async def watch(message: Message) -> None:
            kind = message["type"]
            if kind == "http.response.start":
                status["code"] = message["status"]
            elif kind == "websocket.accept":
                status["code"] = 101
            elif kind == "websocket.close" and status["code"] == 500:
                status["code"] = 403  # closed before it was accepted: refused
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            self._record(scope, status["code"])

    def _record(self, scope: Scope, status: int) -> None:
        who: Principal | None = scope.get("state", {}).get("key_use")
        front: Front | None = getattr(scope["app"].state, "daemon", None)
        if who is None or front is None:
            return
        client = scope.get("client")
        method = scope.get("method") or "WEBSOCKET"
        where = f"{client[0]}:{client[1]}" if client else None
        front.keys.record_use(who, method, scope["path"], status, where, self.keep)
