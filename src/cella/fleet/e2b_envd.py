"""Each sandbox's `envd` (E2B's data plane) on a fleet gateway: a request that names its
sandbox, by the `E2b-Sandbox-Id` header (`E2B_SANDBOX_URL`) or by the host name
`{port}-{sandbox_id}.{domain}` of one of E2B's own guest ports, is streamed to the sandbox's
node as is (Connect streams, file bodies). The node proves the caller with the sandbox's
`X-Access-Token` (or a signed file URL): the gateway lends it no key."""

from __future__ import annotations

from fastapi import APIRouter, FastAPI, Request, Response
from starlette.types import Scope

from cella import errors
from cella.fleet.gateway import Gateway
from cella.fleet.relay import METHODS, forward
from cella.server.compat.e2b import OWN_PORTS
from cella.server.hosts import NAME, HostRouting, add_own_ports

HEADER = "e2b-sandbox-id"
PATHS = (
    "/process.Process/{rest:path}",
    "/filesystem.Filesystem/{rest:path}",
    "/files",
    "/health",
    "/execute",
    "/contexts",
    "/contexts/{rest:path}",
)


class EnvdHosts(HostRouting):
    """Host names of E2B's own guest ports gain the header that names their sandbox; other
    ports' host names are served by the nodes' own URLs (the gateway keeps its paths)."""

    def route(self, scope: Scope, own: object) -> Scope:
        host = next((v for k, v in scope["headers"] if k == b"host"), b"").decode("latin-1")
        found = NAME.match(host.lower())
        if found is None or int(found.group(1)) not in OWN_PORTS:
            return scope
        return super().route(scope, OWN_PORTS)


def install(app: FastAPI, gateway: Gateway) -> None:
    app.include_router(router(gateway))
    add_own_ports(app, OWN_PORTS)
    app.add_middleware(EnvdHosts, domain=gateway.settings.ports_domain)


def router(gateway: Gateway) -> APIRouter:
    api = APIRouter(include_in_schema=False)

    async def relayed(request: Request) -> Response:
        sandbox_id = request.headers.get(HEADER, "")
        node = gateway.locator.serving(sandbox_id) if sandbox_id else None
        if node is None:  # what envd's SDK reads as a sandbox that is not running
            raise errors.AgentUnavailable(f"The sandbox {sandbox_id} was not found")
        # envd's user (`Authorization: Basic`) is the caller's to name; no key goes along
        given = request.headers.get("authorization", "")
        basic = {"authorization": given} if given.lower().startswith("basic ") else None
        return await forward(request, node, None, node_key=False, extra=basic)

    for path in PATHS:
        api.add_api_route(path, relayed, methods=METHODS)
    return api
