"""Ports: servers in a sandbox, reached through the daemon.

- `POST /v1/sandboxes/{id}/ports/{port}/expose` mints a service URL with a short-lived token.
- `/v1/services/{id}/{port}/...` forwards HTTP (and WebSockets) to the guest port, for
  whoever holds the token: in a header (`X-Cella-Service-Token`, or the LangSmith SDK's
  `X-Langsmith-Sandbox-Service-Token`), in a cookie, or once in the URL (`?cella_token=`:
  a browser gets the cookie and the same URL without it).
- `POST /v1/sandboxes/{id}/ports/{port}/login-url` gives a login-mode URL instead:
  `/v1/logins/{id}/{port}/...` forwards HTTP for whoever holds a key or console session of
  the sandbox's tenant, and tells the guest's server who that is (`cella.service.logins`:
  a user token signed by the daemon, the guest's `Host` the one the caller used, its
  audience). The caller's credentials never reach the guest.
- `WS /v1/sandboxes/{id}/ports/{port}/connect` carries one raw TCP connection (API key
  auth) as binary messages; an empty message is the end of one direction (a TCP half
  close): what `cella sandbox port-forward` uses.

A guest's HTTP response is untrusted (`guest_reply`). On the daemon's own host (the path
forms, and foreign APIs' relays) it is served with a sandboxing CSP, without headers that
act on the whole origin, and its cookies stay inside its port's path; by a sandbox port's
host name it is on an origin of its own, and only cookies that would reach beyond that
host are dropped.
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

from cella.guest.client import GuestStream
from cella.models import ExposedPort, ExposeRequest, LoginUrl
from cella.server.deps import Auth, DaemonDep, KeyOrSession, daemon
from cella.server.hosts import ROUTED_HOST
from cella.server.sockets import bearer, opened
from cella.server.websocket_relay import relay
from cella.service.daemon import Daemon
from cella.service.keys import Principal
from cella.service.logins import FLEET_USER, USER_HEADERS, USER_ID_HEADER, USER_TOKEN_HEADER
from cella.service.ports import HttpResponse, ServiceToken, guest_path

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
# response headers that act on a whole origin (its cookies and storage, HTTPS, where its
# traffic goes, where its errors are reported): not a guest's to set on the daemon's
ORIGIN_WIDE = frozenset(
    {
        "clear-site-data",
        "strict-transport-security",
        "alt-svc",
        "nel",
        "report-to",
        "reporting-endpoints",
        "service-worker-allowed",
    }
)
ACCESS_HEADER = "x-access-token"  # the sandbox's access token (E2B's envd and interpreter)
LOGINS = "/v1/logins"


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
    sandbox_id: str, port: PortP, body: ExposeRequest, request: Request, svc: DaemonDep, who: Auth
) -> ExposedPort:
    """A service URL for a server listening on `port` inside the sandbox."""
    return exposed(request, svc.ports.mint(who, sandbox_id, port, body.expires_in_seconds))


def login_url(request: Request, sandbox_id: str, port: int) -> LoginUrl:
    base = str(request.base_url).rstrip("/")
    return LoginUrl(
        port=port,
        url=f"{base}{LOGINS}/{sandbox_id}/{port}",
        jwks_url=f"{base}/.well-known/jwks.json",
    )


@router.post("/v1/sandboxes/{sandbox_id}/ports/{port}/login-url", response_model=LoginUrl)
async def login(
    sandbox_id: str, port: PortP, request: Request, svc: DaemonDep, who: Auth
) -> LoginUrl:
    """A login-mode URL for a server on `port`: no token, no expiry; a key or console
    session that may exec in the sandbox opens it, and the server is told who (a signed
    user token)."""
    svc.registry.get(who, sandbox_id)
    return login_url(request, sandbox_id, port)


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
    sandbox_id: str, port: PortP, path: str, request: Request, svc: DaemonDep
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
    holder = Principal.service(token.tenant)  # the token is the holder's right to the port
    await svc.waking.on_traffic(sandbox_id)  # one made with auto_resume wakes for it
    reply, sent = await _forward(request, svc, holder, sandbox_id, port, path)
    prefix = f"/v1/services/{sandbox_id}/{port}"
    return guest_reply(reply, lambda c: cookie_under(c, prefix, sent), sandboxed=True)


@router.api_route(
    "/v1/hosts/{sandbox_id}/{port}/{path:path}",
    methods=SERVICE_METHODS,
    include_in_schema=False,
)
async def by_host(
    sandbox_id: str, port: PortP, path: str, request: Request, svc: DaemonDep
) -> Response:
    """`{port}-{sandbox_id}.{domain}` (see `cella.server.hosts`): its own origin. Asked for
    by this path on the daemon's host instead, it is served as a service URL is."""
    caller = _host_caller(svc, request, sandbox_id, port)
    await svc.waking.on_traffic(sandbox_id)
    reply, sent = await _forward(request, svc, caller, sandbox_id, port, path)
    if host := request.scope.get(ROUTED_HOST):
        return guest_reply(reply, lambda c: cookie_for_host(c, host), sandboxed=False)
    prefix = f"/v1/hosts/{sandbox_id}/{port}"
    return guest_reply(reply, lambda c: cookie_under(c, prefix, sent), sandboxed=True)


@router.api_route(
    LOGINS + "/{sandbox_id}/{port}/{path:path}",
    methods=SERVICE_METHODS,
    include_in_schema=False,
)
async def login_service(
    sandbox_id: str, port: PortP, path: str, request: Request, svc: DaemonDep, who: KeyOrSession
) -> Response:
    host = request.headers.get("host") or request.url.netloc
    subject = _subject(request, who)
    token = svc.logins.user_token(
        who,
        sandbox_id,
        subject,
        audience=host,
        issuer=str(request.base_url).rstrip("/"),
    )
    headers = [
        (k, v)
        for k, v in guest_headers(request.headers.items())
        if k.lower() not in ("authorization", "x-api-key") and not k.lower().startswith("x-cella-")
    ]
    headers += [(USER_TOKEN_HEADER, token), (USER_ID_HEADER, subject)]
    sent = guest_path(path)
    target = sent + (f"?{request.url.query}" if request.url.query else "")
    reply = await svc.ports.http(
        who, sandbox_id, port, request.method, target, headers, request.stream(), host
    )
    prefix = f"{LOGINS}/{sandbox_id}/{port}"
    return guest_reply(reply, lambda c: cookie_under(c, prefix, sent), sandboxed=True)


def _subject(request: Request, who: Principal) -> str:
    """Who a login-mode request is from: the caller's key id; through a fleet gateway (its
    key acting for the tenant), the gateway's caller."""
    if request.headers.get("x-cella-tenant") and (user := request.headers.get(FLEET_USER)):
        return user
    return who.key_id or f"tenant:{who.tenant}"


def _host_caller(svc: Daemon, conn: Request | WebSocket, sandbox_id: str, port: int) -> Principal:
    """Whom a request to a port by host name acts for (`Ports.host_caller`)."""
    return svc.ports.host_caller(
        sandbox_id,
        port,
        access=conn.headers.get(ACCESS_HEADER, ""),
        traffic=conn.headers.get(TRAFFIC_HEADER, ""),
        service_token=_token(conn, sandbox_id, port) or "",
    )


async def _forward(
    request: Request, svc: Daemon, who: Principal, sandbox_id: str, port: int, path: str
) -> tuple[HttpResponse, str]:
    """The guest server's response, and the path it was asked for."""
    sent = guest_path(path)
    target = sent + (f"?{request.url.query}" if request.url.query else "")
    headers = guest_headers(request.headers.items())
    reply = await svc.ports.http(
        who, sandbox_id, port, request.method, target, headers, request.stream()
    )
    return reply, sent


def guest_reply(
    reply: HttpResponse, cookie: Callable[[str], str | None], sandboxed: bool
) -> StreamingResponse:
    """A guest server's response as the browser gets it: each `Set-Cookie` as `cookie`
    keeps it (or drops it: None); `sandboxed` (on the daemon's own host) adds the
    sandboxing CSP beside any of the guest's and drops headers that act on the origin."""
    headers = []
    for key, value in reply.headers:
        name = key.lower()
        if name == "set-cookie":
            kept = cookie(value)
            if kept is None:
                continue
            value = kept
        elif sandboxed and name in ORIGIN_WIDE:
            continue
        headers.append((name, value))
    if sandboxed:
        headers.append(("content-security-policy", SANDBOXED))
    response = StreamingResponse(reply.body, status_code=reply.status)
    response.raw_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers]
    return response


def cookie_under(header: str, prefix: str, sent: str) -> str | None:
    """A guest's cookie set on the daemon's own host: kept inside its port's path (the
    guest's `Path`, or the default for the path it was sent, under `prefix`), without a
    `Domain`, and never under one of the daemon's names or without a name (a nameless
    cookie reaches servers as `name=value` of its value)."""
    name, attributes = _parse_cookie(header)
    if not name or name.startswith(OWN_COOKIES) or "domain" in _named(attributes):
        return None
    path = _named(attributes).get("path", "")
    if not path.startswith("/"):
        path = sent[: sent.rindex("/")] or "/"  # RFC 6265's default path
    kept = [a for a in attributes if _attribute_name(a) != "path"]
    return "; ".join([header.split(";")[0].strip(), *kept, f"Path={prefix}{path}"])


def cookie_for_host(header: str, host: str) -> str | None:
    """A guest's cookie set on its own host name: its server's business, unless a `Domain`
    would carry it beyond that host (to the daemon's, or a parent domain's)."""
    name, attributes = _parse_cookie(header)
    domain = _named(attributes).get("domain", "").strip().lstrip(".").lower()
    if not name or domain not in ("", host):
        return None
    return header


def _parse_cookie(header: str) -> tuple[str, list[str]]:
    """A `Set-Cookie` value's name (empty when it has none) and its attributes."""
    first, *attributes = header.split(";")
    name, equals, _ = first.partition("=")
    return (name.strip() if equals else ""), [a.strip() for a in attributes if a.strip()]


def _attribute_name(attribute: str) -> str:
    return attribute.partition("=")[0].strip().lower()


def _named(attributes: list[str]) -> dict[str, str]:
    """Attributes by lower-case name, the last one winning as in browsers."""
    return {_attribute_name(a): a.partition("=")[2].strip() for a in attributes}


def guest_headers(headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """A request's headers as the guest's server gets them: without the daemon's
    credentials (tokens, and its own cookies: the console's session among them)."""
    kept = []
    for key, value in headers:
        name = key.lower()
        if name in CREDENTIALS or name in USER_HEADERS:  # the daemon says who, or no one
            continue
        if name == "cookie":
            pairs = [p.strip() for p in value.split(";")]
            value = "; ".join(p for p in pairs if p and not p.startswith(OWN_COOKIES))
            if not value:
                continue
        kept.append((key, value))
    return kept


@router.websocket("/v1/services/{sandbox_id}/{port}/{path:path}")
async def service_websocket(ws: WebSocket, sandbox_id: str, port: int, path: str) -> None:
    """A WebSocket to the guest server, relayed message by message."""

    def caller(svc: Daemon) -> Principal:
        token = svc.ports.verify(_token(ws, sandbox_id, port) or "", sandbox_id, port)
        return Principal.service(token.tenant)

    await _relay(ws, sandbox_id, port, path, caller)


@router.websocket("/v1/hosts/{sandbox_id}/{port}/{path:path}")
async def by_host_websocket(ws: WebSocket, sandbox_id: str, port: int, path: str) -> None:
    await _relay(ws, sandbox_id, port, path, lambda svc: _host_caller(svc, ws, sandbox_id, port))


async def _relay(
    ws: WebSocket, sandbox_id: str, port: int, path: str, caller: Callable[[Daemon], Principal]
) -> None:
    svc = daemon(ws)

    async def guest_port() -> GuestStream:
        who = caller(svc)
        await svc.waking.on_traffic(sandbox_id)
        return await svc.ports.open(who, sandbox_id, port)

    # accepted by the relay once the guest's server has accepted
    stream = await opened(ws, guest_port, accept=False)
    if stream is None:
        return
    target = guest_path(path) + (f"?{ws.url.query}" if ws.url.query else "")
    await relay(ws, stream, port, target)


@router.websocket("/v1/sandboxes/{sandbox_id}/ports/{port}/connect")
async def connect(ws: WebSocket, sandbox_id: str, port: int) -> None:
    """One TCP connection to `port` inside the sandbox, as binary messages both ways."""

    async def guest_port() -> GuestStream:
        return await daemon(ws).ports.open(bearer(ws), sandbox_id, port)

    stream = await opened(ws, guest_port)
    if stream is not None:
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
