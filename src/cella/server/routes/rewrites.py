"""The egress proxy's door for rewrite rules (`cella.service.rewrites`): a sandbox's request
to a rewrite's host arrives here, with the proxy's token for that sandbox, and is answered by
the other sandbox's port. Not part of the public API: no key opens it, only the token the
daemon gave its own proxy. The path after `/v1/rewrites/{sandbox_id}/{host}` is sent to the
guest's server as the sandbox sent it (not normalised: it is the sandbox's request to
another of its tenant's servers, not a page on the daemon's origin)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from cella.policy.rewrites import HOST_HEADER, PREFIX, TOKEN_HEADER
from cella.server.deps import DaemonDep

router = APIRouter(tags=["rewrites"])
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
OWN = (TOKEN_HEADER, HOST_HEADER)


@router.api_route(
    PREFIX + "/{sandbox_id}/{host}/{path:path}", methods=METHODS, include_in_schema=False
)
async def rewrite(
    sandbox_id: str, host: str, path: str, request: Request, svc: DaemonDep
) -> Response:
    raw = request.scope.get("raw_path") or request.url.path.encode()
    prefix = f"{PREFIX}/{sandbox_id}/{host}".encode()
    target = raw.decode("latin-1")[len(prefix) :] if raw.startswith(prefix) else "/" + path
    target = (target or "/") + (f"?{request.url.query}" if request.url.query else "")
    headers = [(k, v) for k, v in request.headers.items() if k.lower() not in OWN]
    reply = await svc.rewrites.forward(
        sandbox_id,
        host,
        request.headers.get(TOKEN_HEADER, ""),
        (request.method, target, headers),
        request.stream(),
        request.headers.get(HOST_HEADER) or host,
    )
    response = StreamingResponse(reply.body, status_code=reply.status)
    response.raw_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in reply.headers]
    return response
