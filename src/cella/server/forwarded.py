"""`X-Forwarded-Proto`: the scheme the client used, when a fleet gateway or a proxy that
terminates TLS stands in front. URLs the daemon hands out (service URLs, the LangSmith
data plane's) are built from the request, so they must carry the client's scheme, not the
hop's. Only the scheme is taken: it changes nothing but those URLs."""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

SCHEMES = {
    ("http", "http"): "http",
    ("http", "https"): "https",
    ("websocket", "http"): "ws",
    ("websocket", "https"): "wss",
}


class ForwardedProto:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            for name, value in scope["headers"]:
                if name == b"x-forwarded-proto":
                    proto = value.decode("latin-1").split(",")[0].strip().lower()
                    if scheme := SCHEMES.get((scope["type"], proto)):
                        scope = {**scope, "scheme": scheme}
                    break
        await self.app(scope, receive, send)
