"""Every HTTP request's route template, status and time, and every error answer's code, for
/metrics (`cella.telemetry.prometheus`). WebSockets are not timed: they last a session."""

from __future__ import annotations

import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cella.server.front import front_of_scope

ERROR_CODE = "cella.error_code"  # what an error handler answered, set in the request's scope


class RequestMetrics:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception:
            scope.setdefault(ERROR_CODE, "internal")
            raise
        finally:
            front = front_of_scope(scope)
            if front is not None:
                route = scope.get("route")
                template = getattr(route, "path", None) or "unmatched"
                front.prometheus.request(
                    scope["method"], template, status, time.perf_counter() - started
                )
                if code := scope.get(ERROR_CODE):
                    front.prometheus.error(str(code))
