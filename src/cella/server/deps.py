"""What routes depend on: the daemon (`DaemonDep`), or for the routes a fleet gateway serves
too, whichever of the two serves them (`FrontDep`); the caller (`Auth`); JSON Lines
framing."""

from __future__ import annotations

import json
import re
from typing import Annotated, Any

from fastapi import Depends, Header
from starlette.requests import HTTPConnection

from cella import errors
from cella.models.keys import TENANT
from cella.policy.access import Role, roles_of, valid_principal
from cella.server.front import Front, front_of
from cella.service.daemon import Daemon
from cella.service.delegation import FLEET_GRANT
from cella.service.keys import (
    PRINCIPAL_HEADER,
    READ_ONLY_HEADER,
    READS,
    ROLES_HEADER,
    Principal,
    require_admin,
    require_write,
)

SESSION_COOKIE = "cella_session"
CSRF_HEADER = "x-csrf-token"
CSRF_QUERY = "csrf"


def daemon(request: HTTPConnection) -> Daemon:
    found: Daemon = request.app.state.daemon
    return found


def principal(
    request: HTTPConnection,
    authorization: Annotated[str | None, Header()] = None,
    x_cella_tenant: Annotated[
        str | None,
        Header(description="an admin key acts as this tenant (e.g. a fleet gateway's calls)"),
    ] = None,
) -> Principal:
    if not authorization:
        if session := request.cookies.get(SESSION_COOKIE):
            return from_session(request, session, x_cella_tenant)
        raise errors.Unauthenticated("an API key is required (Authorization: Bearer <key>)")
    scheme, _, key = authorization.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise errors.Unauthenticated("use Authorization: Bearer <key>")
    return admitted(request, key.strip(), x_cella_tenant)


def admitted(conn: HTTPConnection, key: str, tenant: str | None) -> Principal:
    """The principal of `key` for this request: a read-only key only reads (a WebSocket
    runs commands or carries traffic: never a read), and the request is remembered for
    the audit log of key use (`cella.server.audit`)."""
    who = front_of(conn).keys.authenticate(key)
    method = conn.scope.get("method") or "WEBSOCKET"
    conn.state.key_use = who  # before any refusal: refused uses are logged too
    require_write(who, method)
    return acting(who, tenant, conn)


def from_session(conn: HTTPConnection, token: str, tenant: str | None) -> Principal:
    """The principal of a web console session (its cookie). Whatever is not a read needs the
    session's CSRF token (header, or `csrf` query parameter for WebSockets, which also
    must come from this origin)."""
    sessions = front_of(conn).sessions
    who = sessions.principal(token)
    method = conn.scope.get("method") or "WEBSOCKET"
    conn.state.key_use = who
    if method not in READS:
        if method == "WEBSOCKET":
            same_origin(conn)
            given = conn.query_params.get(CSRF_QUERY)
        else:
            given = conn.headers.get(CSRF_HEADER)
        sessions.check_csrf(token, given)
    require_write(who, method)
    return acting(who, tenant, conn)


def same_origin(conn: HTTPConnection) -> None:
    origin = conn.headers.get("origin")
    host = conn.headers.get("host")
    if not origin or not host or origin.partition("://")[2] != host:
        raise errors.PermissionDenied(f"a session WebSocket from another origin: {origin!r}")


def acting(who: Principal, tenant: str | None, conn: HTTPConnection) -> Principal:
    """`who`, or with `X-Cella-Tenant` the tenant an admin key acts for: as its owner, or
    the principal and roles `X-Cella-Principal` and `X-Cella-Roles` name; with
    `X-Cella-Read-Only` too, as a read-only key of that tenant (a fleet gateway relaying a
    read-only caller: a read must not wake a sandbox on the node)."""
    if tenant is None:
        return who
    require_admin(who, "act for another tenant (X-Cella-Tenant)")
    if not re.fullmatch(TENANT, tenant):
        raise errors.InvalidArgument(f"X-Cella-Tenant: not a tenant name: {tenant!r}")
    name, roles = relayed_principal(conn)
    read_only = conn.headers.get(READ_ONLY_HEADER) == "1" or Role.viewer in roles
    acted = Principal(tenant, False, read_only, who.key_id, name, roles)
    require_write(acted, conn.scope.get("method") or "WEBSOCKET")
    return acted


def fleet_grant(conn: HTTPConnection) -> str | None:
    """The access delegation grant a fleet gateway sends with a create it places here
    (`X-Cella-Grant`): only from an admin key acting for a tenant."""
    given = conn.headers.get(FLEET_GRANT)
    if given is None:
        return None
    used = getattr(conn.state, "key_use", None)
    if used is None or not used.admin or not conn.headers.get("x-cella-tenant"):
        raise errors.PermissionDenied(
            f"{FLEET_GRANT}: only a fleet gateway (an admin key acting for a tenant) sends one"
        )
    return given


def relayed_principal(conn: HTTPConnection) -> tuple[str, frozenset[Role]]:
    """The principal and roles an admin key acting for a tenant names (none: the tenant's
    owner)."""
    name = conn.headers.get(PRINCIPAL_HEADER, "")
    if name and not valid_principal(name):
        raise errors.InvalidArgument(f"{PRINCIPAL_HEADER}: not a principal name: {name!r}")
    given = [r.strip() for r in conn.headers.get(ROLES_HEADER, "").split(",") if r.strip()]
    try:
        return name, roles_of([Role(r) for r in given], read_only=False)
    except ValueError as exc:
        raise errors.InvalidArgument(f"{ROLES_HEADER}: {exc}") from None


def api_key_caller(
    request: HTTPConnection,
    x_api_key: Annotated[str | None, Header()] = None,
    x_cella_tenant: Annotated[str | None, Header()] = None,
) -> Principal:
    """The caller of a foreign API that sends its key as `X-Api-Key` (LangSmith's, E2B's)."""
    if not x_api_key:
        raise errors.Unauthenticated("an API key is required (X-Api-Key)")
    return admitted(request, x_api_key.strip(), x_cella_tenant)


def key_or_session(
    request: HTTPConnection,
    authorization: Annotated[str | None, Header()] = None,
    x_api_key: Annotated[str | None, Header()] = None,
    x_cella_tenant: Annotated[str | None, Header()] = None,
) -> Principal:
    """A caller by cella's key, LangSmith's (`X-Api-Key`) or a console session: how a
    login-mode service URL is opened."""
    if x_api_key and not authorization:
        return admitted(request, x_api_key.strip(), x_cella_tenant)
    return principal(request, authorization, x_cella_tenant)


# FastAPI runs a plain function dependency in a worker thread: a hop per dependency of
# every request. These are quick (app state, a key's row by its hash), so they run on the
# event loop instead, as coroutines.


async def _principal(
    request: HTTPConnection,
    authorization: Annotated[str | None, Header()] = None,
    x_cella_tenant: Annotated[
        str | None,
        Header(description="an admin key acts as this tenant (e.g. a fleet gateway's calls)"),
    ] = None,
) -> Principal:
    return principal(request, authorization, x_cella_tenant)


async def _key_or_session(
    request: HTTPConnection,
    authorization: Annotated[str | None, Header()] = None,
    x_api_key: Annotated[str | None, Header()] = None,
    x_cella_tenant: Annotated[str | None, Header()] = None,
) -> Principal:
    return key_or_session(request, authorization, x_api_key, x_cella_tenant)


async def _api_key_caller(
    request: HTTPConnection,
    x_api_key: Annotated[str | None, Header()] = None,
    x_cella_tenant: Annotated[str | None, Header()] = None,
) -> Principal:
    return api_key_caller(request, x_api_key, x_cella_tenant)


async def _daemon(request: HTTPConnection) -> Daemon:
    return daemon(request)


async def _front(conn: HTTPConnection) -> Front:
    return front_of(conn)


Auth = Annotated[Principal, Depends(_principal)]
KeyOrSession = Annotated[Principal, Depends(_key_or_session)]
Caller = Annotated[Principal, Depends(_api_key_caller)]
DaemonDep = Annotated[Daemon, Depends(_daemon)]
FrontDep = Annotated[Front, Depends(_front)]
IdempotencyKey = Annotated[
    str | None,
    Header(
        alias="Idempotency-Key",
        description="retries with this key (and the same body) get what the first request "
        "made, once; kept a day",
    ),
]


def jsonl(obj: Any) -> bytes:
    return (json.dumps(obj, separators=(",", ":")) + "\n").encode()
