"""Servers in sandboxes by host name: a request for `{port}-{sandbox_id}.{domain}` (E2B's
`get_host(port)`, under a wildcard DNS name for the daemon) goes to that port in that
sandbox. The ports of a foreign API's own guest services (E2B's envd and code interpreter, which
its adapter registers with `add_own_ports`) keep their paths and only gain the header that
names the sandbox; every other port is
served by `/v1/hosts/{sandbox_id}/{port}/...`, which decides who may reach it. The request
keeps the host name it came by (`ROUTED_HOST` in its scope): its pages are on that origin,
not the daemon's."""

from __future__ import annotations

import re
from collections.abc import Mapping

from starlette.applications import Starlette
from starlette.types import ASGIApp, Receive, Scope, Send

NAME = re.compile(r"^(\d{1,5})-(sb-[0-9a-f]+)\.(.+)$")
ROUTED_HOST = "cella.sandbox_host"  # scope key: the sandbox port's host name, without port


def host_path(sandbox_id: str, port: int, path: str) -> str:
    return f"/v1/hosts/{sandbox_id}/{port}{path}"


def add_own_ports(app: Starlette, ports: Mapping[int, str]) -> None:
    """Ports of a foreign API's own guest services, each with the header that names the
    sandbox to them."""
    own_ports(app).update(ports)


def own_ports(app: Starlette) -> dict[int, str]:
    found: dict[int, str] | None = getattr(app.state, "own_ports", None)
    if found is None:
        found = app.state.own_ports = {}
    return found


class HostRouting:
    """ASGI middleware: requests whose Host is a sandbox port's name are routed there."""

    def __init__(self, app: ASGIApp, domain: str) -> None:
        self.app = app
        self.domain = domain.lower()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            scope = self.route(scope, own_ports(scope["app"]))
        await self.app(scope, receive, send)

    def route(self, scope: Scope, own: Mapping[int, str]) -> Scope:
        host = next((v for k, v in scope["headers"] if k == b"host"), b"").decode("latin-1")
        found = NAME.match(host.lower())
        if found is None or found.group(3) != self.domain:
            return scope
        port, sandbox_id = int(found.group(1)), found.group(2)
        if port in own:
            named = (own[port].encode(), sandbox_id.encode())
            kept = [(k, v) for k, v in scope["headers"] if k != named[0]]
            return {**scope, "headers": [*kept, named]}
        prefix = host_path(sandbox_id, port, "")
        raw = scope.get("raw_path") or scope["path"].encode()
        return {
            **scope,
            "path": prefix + scope["path"],
            "raw_path": prefix.encode() + raw,
            ROUTED_HOST: host.lower().partition(":")[0],
        }
