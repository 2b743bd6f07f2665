"""The audit log of key use: every request that presented a valid API key (refused ones
included) as key id, tenant, method, path, status and client address, in the database
(`key_uses`, the newest `audit_keep` entries). Paths only: no query strings, bodies or
headers, so nothing a request carries (file contents, secret values) is logged."""

from __future__ import annotations

from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cella.service.keys import Principal
from cella.store import KeyUse
from cella.store.db import now


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
        daemon: Any = getattr(scope["app"].state, "daemon", None)
        if who is None or who.key_id is None or daemon is None:
            return
        client = scope.get("client")
        use = KeyUse(
            key_id=who.key_id,
            tenant=who.tenant,
            at=now(),
            method=scope.get("method") or "WEBSOCKET",
            path=scope["path"],
            status=status,
            client=f"{client[0]}:{client[1]}" if client else None,
        )
        daemon.store.add_key_uses([use], self.keep)
