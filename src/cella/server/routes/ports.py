"""Ports: servers in a sandbox, reached through the daemon.

- `POST /v1/sandboxes/{id}/ports/{port}/expose` mints a service URL with a short-lived token.
- `/v1/services/{id}/{port}/...` forwards HTTP (and WebSockets) to the guest port, for
  whoever holds the token: in a header (`X-Cella-Service-Token`, or the LangSmith SDK's
  `X-Langsmith-Sandbox-Service-Token`), in a cookie, or once in the URL (`?cella_token=`:
  a browser gets the cookie and the same URL without it).
- `WS /v1/sandboxes/{id}/ports/{port}/connect` carries one raw TCP connection (API key
  auth) as binary messages; an empty message is the end of one direction (a TCP half
  close): what `cella sandbox port-forward` uses.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Path, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import RedirectResponse, Response, StreamingResponse
from starlette.datastructures import URL

from cella import errors
from cella.guest.client import GuestStream
from cella.models import ExposedPort, ExposeRequest
from cella.server.deps import Auth, Service, daemon, principal
from cella.service.daemon import Daemon
from cella.service.ports import ServiceToken

router = APIRouter(tags=["ports"])
PortP = Annotated[int, Path(ge=1, le=65535, description="TCP port inside the sandbox")]
TOKEN_HEADERS = ("x-cella-service-token", "x-langsmith-sandbox-service-token")
TOKEN_QUERY = "cella_token"
TRAFFIC_HEADER = "e2b-traffic-access-token"
CREDENTIALS = (*TOKEN_HEADERS, TRAFFIC_HEADER)  # for the daemon, never passed to the guest
OWN_COOKIES = ("cella_session", "cella_service_")  # the daemon's cookies, kept from guests
# A page served under the daemon's own origin must not act as the daemon's origin: without
# `allow-same-origin` it runs in an opaque origin that cannot read the console's session
# nor send it (servers that need an origin of their own are reached by host name).
SANDBOXED = "sandbox allow-scripts allow-forms allow-popups allow-modals allow-downloads"


def service_url(request: Request | WebSocket, sandbox_id: str, port: int) -> str:
    return str(request.base_url).rstrip("/") + f"/v1/services/{sandbox_id}/{port}"


def exposed(request: Request, token: ServiceToken) -> ExposedPort:
    url = service_url(request, token.sandbox_id, token.port)
    return ExposedPort(
        port=token.port,
        url=url,
        browser_url=f"{url}/?{TOKEN_QUERY}={token.token}",
        token=token.token,
        expires_at=datetime.fromtimestamp(token.expires_at, UTC),
    )


@router.post("/v1/sandboxes/{sandbox_id}/ports/{port}/expose", response_model=ExposedPort)
async def expose(
    sandbox_id: str, port: PortP, body: ExposeRequest, request: Request, svc: Service, who: Auth
) -> ExposedPort:
    """A service URL for a server listening on `port` inside the sandbox."""
    return exposed(request, svc.ports.mint(who.tenant, sandbox_id, port, body.expires_in_seconds))


def _token(request: Request | WebSocket, sandbox_id: str, port: int) -> str | None:
    for name in TOKEN_HEADERS:
        if value := request.headers.get(name):
            return value
    return request.cookies.get(_cookie(sandbox_id, port)) or request.query_params.get(TOKEN_QUERY)


def _cookie(sandbox_id: str, port: int) -> str:
    return f"cella_service_{sandbox_id}_{port}"


SERVICE_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]


@router.api_route(
    "/v1/services/{sandbox_id}/{port}/{path:path}",
    methods=SERVICE_METHODS,
    include_in_schema=False,
)
async def service(
    sandbox_id: str, port: PortP, path: str, request: Request, svc: Service
) -> Response:
    token = svc.ports.verify(_token(request, sandbox_id, port) or "", sandbox_id, port)
    if TOKEN_QUERY in request.query_params:  # a browser: the cookie, then the clean URL
        clean = URL(str(request.url)).remove_query_params(TOKEN_QUERY)
        redirect = RedirectResponse(
            str(clean), status_code=303, headers={"content-security-policy": SANDBOXED}
        )
        redirect.set_cookie(
            _cookie(sandbox_id, port),
            token.token,
            max_age=int(token.expires_at - datetime.now(UTC).timestamp()),
            httponly=True,
            samesite="lax",
            path=f"/v1/services/{sandbox_id}/{port}",
        )
        return redirect
    reply = await _forward(request, svc, token.tenant, sandbox_id, port, path)
    reply.headers.append("content-security-policy", SANDBOXED)  # beside any of its own
    return reply


@router.api_route(
    "/v1/hosts/{sandbox_id}/{port}/{path:path}",
    methods=SERVICE_METHODS,
    include_in_schema=False,
)
async def by_host(
    sandbox_id: str, port: PortP, path: str, request: Request, svc: Service
) -> Response:
    """`{port}-{sandbox_id}.{domain}` (see `cella.server.hosts`)."""
    tenant = _host_caller(svc, request, sandbox_id, port)
    return await _forward(request, svc, tenant, sandbox_id, port, path)


def _host_caller(svc: Daemon, conn: Request | WebSocket, sandbox_id: str, port: int) -> str:
    """The tenant a request to a port by host name acts for: anyone's, when the sandbox's
    ports are public; else only with its traffic token (E2B's) or a service token."""
    row = svc.store.get_sandbox(sandbox_id)
    if row is None:
        raise errors.NotFound(f"no sandbox {sandbox_id}")
    if not row.network.public_ports:
        if traffic := conn.headers.get(TRAFFIC_HEADER):
            svc.ports.check_traffic(row.id, traffic)
        else:
            svc.ports.verify(_token(conn, sandbox_id, port) or "", sandbox_id, port)
    return row.tenant


async def _forward(
    request: Request, svc: Daemon, tenant: str, sandbox_id: str, port: int, path: str
) -> Response:
    target = "/" + path + (f"?{request.url.query}" if request.url.query else "")
    headers = guest_headers(request.headers.items())
    reply = await svc.ports.http(
        tenant, sandbox_id, port, request.method, target, headers, request.stream()
    )
    return StreamingResponse(
        reply.body, status_code=reply.status, headers=dict(_merge(reply.headers))
    )


def guest_headers(headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """A request's headers as the guest's server gets them: without the daemon's
    credentials (tokens, and its own cookies: the console's session among them)."""
    kept = []
    for key, value in headers:
        name = key.lower()
        if name in CREDENTIALS:
            continue
        if name == "cookie":
            pairs = [p.strip() for p in value.split(";")]
            value = "; ".join(p for p in pairs if p and not p.startswith(OWN_COOKIES))
            if not value:
                continue
        kept.append((key, value))
    return kept


def _merge(headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
    # Starlette takes a dict: repeated headers (Set-Cookie aside) are joined
    out: dict[str, str] = {}
    for key, value in headers:
        k = key.lower()
        out[k] = f"{out[k]}, {value}" if k in out and k != "set-cookie" else value
    return list(out.items())


@router.websocket("/v1/services/{sandbox_id}/{port}/{path:path}")
async def service_websocket(ws: WebSocket, sandbox_id: str, port: int, path: str) -> None:
    """A WebSocket to the guest server, relayed message by message."""

    def caller(svc: Daemon) -> str:
        return svc.ports.verify(_token(ws, sandbox_id, port) or "", sandbox_id, port).tenant

    await _relay(ws, sandbox_id, port, path, caller)


@router.websocket("/v1/hosts/{sandbox_id}/{port}/{path:path}")
async def by_host_websocket(ws: WebSocket, sandbox_id: str, port: int, path: str) -> None:
    await _relay(ws, sandbox_id, port, path, lambda svc: _host_caller(svc, ws, sandbox_id, port))


async def _relay(
    ws: WebSocket, sandbox_id: str, port: int, path: str, caller: Callable[[Daemon], str]
) -> None:
    from cella.server.websocket_relay import relay

    svc = daemon(ws)
    try:
        stream = await svc.ports.open(caller(svc), sandbox_id, port)
    except errors.CellaError as exc:
        await ws.close(code=4403, reason=exc.message[:120])
        return
    target = "/" + path + (f"?{ws.url.query}" if ws.url.query else "")
    await relay(ws, stream, port, target)


@router.websocket("/v1/sandboxes/{sandbox_id}/ports/{port}/connect")
async def connect(ws: WebSocket, sandbox_id: str, port: int) -> None:
    """One TCP connection to `port` inside the sandbox, as binary messages both ways."""
    svc = daemon(ws)
    try:
        who = principal(ws, ws.headers.get("authorization"))
        stream = await svc.ports.open(who.tenant, sandbox_id, port)
    except errors.CellaError as exc:
        await ws.close(code=4000 + exc.status, reason=exc.message[:120])
        return
    await ws.accept()
    await pipe(ws, stream)


async def pipe(ws: WebSocket, stream: GuestStream) -> None:
    """Bytes both ways between a WebSocket and a guest stream; an empty message ends one
    direction. Done when both directions have ended, or either side goes away."""

    async def up() -> None:
        while data := await ws.receive_bytes():
            await stream.write(data)
        await stream.write_eof()

    async def down() -> None:
        while data := await stream.read():
            await ws.send_bytes(data)
        await ws.send_bytes(b"")

    tasks = [asyncio.ensure_future(up()), asyncio.ensure_future(down())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        if all(t.done() and not t.exception() for t in tasks):
            with contextlib.suppress(RuntimeError):
                await ws.close()
    except WebSocketDisconnect:
        pass
    finally:
        for task in tasks:
            task.cancel()
        await stream.close()
