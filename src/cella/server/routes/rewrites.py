"""The egress proxy's door for rewrite rules (`cella.service.rewrites`): a sandbox's request
to a rewrite's host arrives here, with the proxy's token for that sandbox, and is answered by
the other sandbox's port. Not part of the public API: no key opens it, only the token the
daemon gave its own proxy. The path after `/v1/rewrites/{sandbox_id}/{host}` is sent to the
guest's server as the sandbox sent it (not normalised: it is the sandbox's request to
another of its tenant's servers, not a page on the daemon's origin).

On a node of a fleet, two doors more for its gateway alone (an admin key): the link that
sends this node's rewrites to the gateway (`PUT /v1/fleet/link`), and the gateway's
delivery of a rewritten request to a sandbox here, as the rule's setter
(`/v1/fleet/rewrites/{sandbox_id}/{port}/...`, with `X-Cella-Fleet-Rewrite`, which the
gateway never relays from its callers)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Path, Request
from fastapi.responses import Response, StreamingResponse

from cella import errors
from cella.policy.rewrites import CARRIED, FLEET_REWRITE, HOST_HEADER, PREFIX, TOKEN_HEADER
from cella.server.deps import Auth, DaemonDep
from cella.service.ports import HttpResponse

router = APIRouter(tags=["rewrites"])
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
OWN = (TOKEN_HEADER, HOST_HEADER)


@router.api_route(
    PREFIX + "/{sandbox_id}/{host}/{path:path}", methods=METHODS, include_in_schema=False
)
async def rewrite(
    sandbox_id: str, host: str, path: str, request: Request, svc: DaemonDep
) -> Response:
    target = _target(request, f"{PREFIX}/{sandbox_id}/{host}", path)
    headers = [(k, v) for k, v in request.headers.items() if k.lower() not in OWN]
    reply = await svc.rewrites.forward(
        sandbox_id,
        host,
        request.headers.get(TOKEN_HEADER, ""),
        (request.method, target, headers),
        request.stream(),
        request.headers.get(HOST_HEADER) or host,
    )
    return _streamed(reply)


@router.put("/v1/fleet/link", status_code=204, include_in_schema=False)
async def link(svc: DaemonDep, who: Auth, given: Annotated[dict[str, Any], Body()]) -> Response:
    await svc.rewrites.set_link(who, given)
    return Response(status_code=204)


@router.api_route(
    "/v1/fleet/rewrites/{sandbox_id}/{port}/{path:path}", methods=METHODS, include_in_schema=False
)
async def delivered(
    sandbox_id: str,
    port: Annotated[int, Path(ge=1, le=65535)],
    path: str,
    request: Request,
    svc: DaemonDep,
    who: Auth,
) -> Response:
    used = getattr(request.state, "key_use", None)
    caller = request.headers.get(FLEET_REWRITE)
    if used is None or not used.admin or not caller:
        raise errors.PermissionDenied("only a fleet gateway delivers rewritten requests")
    target = _target(request, f"/v1/fleet/rewrites/{sandbox_id}/{port}", path)
    headers = [
        (k.lower().removeprefix(CARRIED), v)  # the request's own credentials, as it sent them
        for k, v in request.headers.items()
        if k.lower().startswith(CARRIED)
        or not (k.lower().startswith("x-cella-") or k.lower() in ("authorization", "x-api-key"))
    ]
    shown = request.headers.get(HOST_HEADER) or f"127.0.0.1:{port}"
    reply = await svc.rewrites.deliver(
        who, sandbox_id, port, (request.method, target, headers), request.stream(), shown
    )
    return _streamed(reply)


def _target(request: Request, prefix: str, path: str) -> str:
    """The path (and query) after `prefix`, as the sandbox sent it."""
    raw = request.scope.get("raw_path") or request.url.path.encode()
    target = raw.decode("latin-1")[len(prefix) :] if raw.startswith(prefix.encode()) else "/" + path
    return (target or "/") + (f"?{request.url.query}" if request.url.query else "")


def _streamed(reply: HttpResponse) -> Response:
    response = StreamingResponse(reply.body, status_code=reply.status)
    response.raw_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in reply.headers]
    return response
