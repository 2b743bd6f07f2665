"""The fleet gateway's HTTP API: the same /v1 as a node daemon, for the whole cluster.

Keys live in the gateway (tenants authenticate here); calls go to node daemons with the
node's admin key acting for the caller's tenant. Creates and forks are placed here; every
call on a sandbox is streamed to and from its node as is (bodies, JSON Lines, WebSockets).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request, Response, WebSocket
from fastapi.responses import JSONResponse, StreamingResponse

from cella import __version__, errors
from cella.config import DaemonSettings
from cella.fleet import e2b, e2b_shared, langsmith, move_routes, shared_routes
from cella.fleet.gateway import Gateway
from cella.fleet.jwks import fleet_jwks, fleet_signing_keys, retire_everywhere
from cella.fleet.node_client import Node
from cella.fleet.registries import build_with
from cella.fleet.relay import METHODS, NODE_HINT, forward, relay_websocket
from cella.fleet.status import fleet_capacity, fleet_status
from cella.models import BackupRequest, Capacity, ForkRequest, KeyRotation, SnapshotFromImage
from cella.models.fleet import FleetStatus, Replica
from cella.models.network import Secret, SecretList, SecretPut
from cella.policy.rewrites import FLEET_REWRITE, PREFIX, TOKEN_HEADER
from cella.server.app import build_app, routes
from cella.server.deps import Auth, IdempotencyKey, KeyOrSession
from cella.server.front import serve
from cella.server.routes import evals, keys, registries
from cella.server.routes.egress import SecretName
from cella.server.routes.host import backup_stream
from cella.server.sockets import bearer, opened
from cella.service.idempotency import Idempotency
from cella.service.keys import Principal, require_admin
from cella.service.logins import FLEET_USER

Placed = tuple[Node, Principal]  # a sandbox's node, and the caller acting there


def create_gateway_app(
    settings: DaemonSettings, address: str, node_root: Path | None = None
) -> FastAPI:
    gateway = Gateway(settings, address, node_root)

    app = build_app(
        settings,
        title="cella fleet gateway",
        description="One cella API for the node daemons of a Ray cluster.",
        open_front=lambda: gateway,
        doors=[
            routes(keys.router),  # the gateway's own keys (and their audit log)
            routes(evals.router),  # runs are kept by the gateway (before the catch-all)
            routes(registries.router),  # so are registries
            routes(shared_routes.router(gateway)),  # volumes, webhooks, templates
            routes(move_routes.router(gateway)),  # moves and drains, before the relay
            routes(router(gateway)),
            lambda app: langsmith.install(app, gateway),
            lambda app: e2b.install(app, gateway),  # E2B's sandboxes and envd
            lambda app: e2b_shared.install(app, gateway),
        ],
    )
    serve(app, gateway)  # already, for an app driven in process without its lifespan
    return app


def router(gateway: Gateway) -> APIRouter:
    api = APIRouter()
    # a key claimed at another gateway of the fleet is waited for while that one lives
    idempotency = Idempotency(
        gateway.store, owner=gateway.presence.id, alive=gateway.presence.alive
    )

    async def once(
        who: Principal, route: str, key: str | None, body: Any, make: Any
    ) -> list[dict[str, Any]]:
        """`make()`'s sandboxes, once per `Idempotency-Key`: a retry's read from their
        nodes as they are now."""
        made: dict[str, dict[str, Any]] = {}

        async def ids() -> list[str]:
            out = await make()
            made.update((s["id"], s) for s in out)
            return [s["id"] for s in out]

        got = await idempotency.once(who.tenant, route, key, body, ids)
        return [made.get(i) or await sandbox_json(who, i) for i in got]

    async def sandbox_json(who: Principal, sandbox_id: str) -> dict[str, Any]:
        node = await gateway.locator.node_of(who, sandbox_id)
        shown: dict[str, Any] = await node.json("GET", f"/v1/sandboxes/{sandbox_id}", who)
        return shown

    @api.get("/v1/health", tags=["meta"])
    async def health() -> dict[str, Any]:
        """Liveness, and how many nodes are up (no key needed)."""
        up = gateway.membership.healthy()
        return {
            "ok": bool(up),
            "version": __version__,
            "fleet": True,
            "nodes": len(gateway.membership.nodes),
            "nodes_up": len(up),
            "accel": None,
            "pool": {},
            "pool_size": 0,
        }

    @api.get("/v1/fleet", response_model=FleetStatus, tags=["fleet"])
    async def fleet(who: Auth) -> FleetStatus:
        """Every node: health, capacity (committed and free), sandboxes, cached snapshots."""
        require_admin(who, "see the fleet")
        return await fleet_status(
            gateway.membership, gateway.placements, gateway.growth, gateway.cordons
        )

    @api.get("/v1/capacity", response_model=Capacity, tags=["fleet"])
    async def capacity(who: Auth) -> Capacity:
        require_admin(who, "see the fleet's capacity")
        return await fleet_capacity(gateway.membership)

    @api.post("/v1/sandboxes", status_code=201, tags=["sandboxes"])
    async def create(
        request: Request, who: Auth, idempotency_key: IdempotencyKey = None
    ) -> JSONResponse:
        body = await _json(request)

        async def make() -> list[dict[str, Any]]:
            return [await gateway.launcher.create(who, body, request.headers.get(NODE_HINT))]

        made = await once(who, "sandboxes.create", idempotency_key, body, make)
        return JSONResponse(gateway.replicas.shown(made[0]), status_code=201)

    @api.get("/v1/sandboxes", tags=["sandboxes"])
    async def list_sandboxes(request: Request, who: Auth) -> dict[str, Any]:
        params = [(k, v) for k, v in request.query_params.multi_items()]
        return {"sandboxes": await gateway.locator.list_sandboxes(who, params)}

    @api.get("/v1/sandboxes/{sandbox_id}", tags=["sandboxes"])
    async def get_sandbox(sandbox_id: str, request: Request, who: Auth) -> Response:
        where = await gateway.locator.placement(who, sandbox_id)
        if where.lost:
            return JSONResponse(gateway.replicas.shown(where.shown()))
        if not gateway.replicas.replicated(sandbox_id):
            return await forward(request, await gateway.locator.node_of(who, sandbox_id), who)
        shown = await sandbox_json(who, sandbox_id)
        return JSONResponse(gateway.replicas.shown(shown))

    @api.get("/v1/sandboxes/{sandbox_id}/replica", response_model=Replica, tags=["fleet"])
    async def get_replica(sandbox_id: str, who: Auth) -> Replica:
        """Where the copy of a replicated sandbox's disk is, and how old."""
        await gateway.locator.placement(who, sandbox_id)
        return gateway.replicas.of(sandbox_id)

    @api.post("/v1/sandboxes/{sandbox_id}/replica", response_model=Replica, tags=["fleet"])
    async def refresh_replica(sandbox_id: str, who: Auth) -> Replica:
        """The replica of a running replicated sandbox refreshed now."""
        await gateway.locator.placement(who, sandbox_id)
        gateway.replicas.of(sandbox_id)  # NotFound for one that is not replicated
        return await gateway.replicas.refresh(sandbox_id)

    @api.post("/v1/sandboxes/{sandbox_id}/stop", tags=["sandboxes"])
    async def stop_sandbox(sandbox_id: str, request: Request, who: Auth) -> Response:
        """Relayed; a replicated sandbox's replica is refreshed right after the stop (with
        its memory when the stop kept it)."""
        return await held(sandbox_id, request, who)

    @api.post("/v1/sandboxes/{sandbox_id}/pause", tags=["sandboxes"])
    async def pause_sandbox(sandbox_id: str, request: Request, who: Auth) -> Response:
        """Relayed; a replicated sandbox's replica is refreshed right after the pause, with
        its disk and memory."""
        return await held(sandbox_id, request, who)

    async def held(sandbox_id: str, request: Request, who: Auth) -> Response:
        node = await gateway.locator.node_of(who, sandbox_id)
        if who.read_only or not gateway.replicas.replicated(sandbox_id):
            return await forward(request, node, who)
        sent = await request.body()
        answer = await node.call(
            "POST", request.url.path, who, content=sent,
            headers={"content-type": "application/json"} if sent else {},
        )  # fmt: skip
        if answer.is_success and answer.json().get("state") in ("stopped", "paused"):
            await gateway.replicas.after_stop(sandbox_id)
        return Response(answer.content, answer.status_code, media_type="application/json")

    @api.delete("/v1/sandboxes/{sandbox_id}", tags=["sandboxes"])
    async def delete_sandbox(sandbox_id: str, request: Request, who: Auth) -> Response:
        where = await gateway.locator.placement(who, sandbox_id)
        if where.lost:  # nothing is left of it to delete: forgotten
            await gateway.replicas.forget(sandbox_id)
            gateway.locator.forget(sandbox_id)
            return Response(status_code=204)
        answer = await forward(request, await gateway.locator.node_of(who, sandbox_id), who)
        if answer.status_code < 300:
            await gateway.replicas.forget(sandbox_id)
            gateway.locator.deleted(sandbox_id)
        return answer

    @api.post("/v1/sandboxes/{sandbox_id}/fork", status_code=201, tags=["snapshots"])
    async def fork_sandbox(
        sandbox_id: str,
        body: ForkRequest,
        request: Request,
        who: Auth,
        idempotency_key: IdempotencyKey = None,
    ) -> dict[str, Any]:
        hint = request.headers.get(NODE_HINT)

        async def make() -> list[dict[str, Any]]:
            return await gateway.launcher.fork_sandbox(who, sandbox_id, body.count, hint)

        route = f"sandboxes.fork:{sandbox_id}"
        return {"sandboxes": await once(who, route, idempotency_key, body, make)}

    @api.put("/v1/sandboxes/{sandbox_id}/network", tags=["egress"])
    async def set_network(sandbox_id: str, request: Request, who: Auth) -> Response:
        """Relayed with its rewrites' targets settled among the caller's sandboxes of the
        whole fleet, and the rules kept here with who set them."""
        node = await gateway.locator.node_of(who, sandbox_id)
        settled = await gateway.rewrites.settle(who, await _json(request))
        answer = await node.call("PUT", request.url.path, who, json=settled)
        if answer.is_success:
            gateway.rewrites.record(sandbox_id, who, settled)
        return Response(answer.content, answer.status_code, media_type="application/json")

    @api.api_route(PREFIX + "/{sandbox_id}/{host}/{rest:path}", methods=METHODS,
                   include_in_schema=False)  # fmt: skip
    async def rewritten(sandbox_id: str, host: str, rest: str, request: Request) -> Response:
        """A node's rewritten request (its token, not a key): to the rule's target, on its
        node, as the rule's setter."""
        token = request.headers.get(TOKEN_HEADER, "")
        kept, node = gateway.rewrites.check(sandbox_id, host, token)
        raw = (request.scope.get("raw_path") or request.url.path.encode()).decode("latin-1")
        prefix = f"{PREFIX}/{sandbox_id}/{host}"
        path = raw[len(prefix) :] if raw.startswith(prefix) else "/" + rest
        query = f"?{request.url.query}" if request.url.query else ""
        target = f"/v1/fleet/rewrites/{kept.target}/{kept.port}{path or '/'}{query}"
        return await forward(request, node, kept.setter, target=target,
                             extra={FLEET_REWRITE: sandbox_id})  # fmt: skip

    @api.api_route("/v1/sandboxes/{sandbox_id}/{rest:path}", methods=METHODS, tags=["sandboxes"])
    async def on_sandbox(sandbox_id: str, rest: str, request: Request, who: Auth) -> Response:
        """Every other call on a sandbox, streamed to its node."""
        answer = await forward(request, await gateway.locator.node_of(who, sandbox_id), who)
        if rest == "resume" and request.method == "POST" and answer.status_code < 300:
            gateway.locator.woken(sandbox_id)
        return answer

    @api.api_route("/v1/services/{sandbox_id}/{rest:path}", methods=METHODS, tags=["ports"])
    async def service(sandbox_id: str, rest: str, request: Request) -> Response:
        """A forwarded port: its own token authenticates it, on the node (the node's key
        is not lent to a caller without one)."""
        node = gateway.locator.serving(sandbox_id)
        if node is None:
            raise errors.NotFound(f"no service of sandbox {sandbox_id!r}")
        return await forward(request, node, None, node_key=False)

    @api.api_route("/v1/logins/{sandbox_id}/{rest:path}", methods=METHODS, tags=["ports"])
    async def login_service(
        sandbox_id: str, rest: str, request: Request, who: KeyOrSession
    ) -> Response:
        """A login-mode service URL: the caller is authenticated here, and the node told
        who it is (the guest's user token names the gateway's key id)."""
        node = await gateway.locator.node_of(who, sandbox_id)
        user = who.key_id or f"tenant:{who.tenant}"
        return await forward(request, node, who, extra={FLEET_USER: user})

    @api.api_route("/v1/downloads/{sandbox_id}/{rest:path}", methods=["GET", "HEAD"])
    async def download(sandbox_id: str, rest: str, request: Request) -> Response:
        """A download link: its own token authenticates it, on the node."""
        node = gateway.locator.serving(sandbox_id)
        if node is None:
            raise errors.NotFound(f"no sandbox {sandbox_id!r} to download from")
        return await forward(request, node, None, node_key=False)

    @api.get("/.well-known/jwks.json", tags=["meta"])
    async def jwks() -> dict[str, Any]:
        """Every node's public signing keys (each node signs with its own)."""
        return await fleet_jwks(gateway.membership)

    @api.get("/v1/signing-keys", tags=["keys"])
    async def signing_keys(who: Auth) -> dict[str, Any]:
        """Every node's signing keys (admin)."""
        require_admin(who, "list the signing keys")
        return await fleet_signing_keys(gateway.membership)

    @api.post("/v1/signing-keys/rotate", tags=["keys"])
    async def rotate_signing(who: Auth) -> dict[str, Any]:
        """A new signing key on every node; the old ones stay published."""
        require_admin(who, "rotate the signing keys")
        await gateway.membership.each("POST", "/v1/signing-keys/rotate", None)
        return await fleet_signing_keys(gateway.membership)

    @api.delete("/v1/signing-keys/{kid}", status_code=204, tags=["keys"])
    async def retire_signing(kid: str, who: Auth) -> Response:
        """Retires a key on the node that has it."""
        require_admin(who, "retire a signing key")
        await retire_everywhere(gateway.membership, kid)
        return Response(status_code=204)

    @api.get("/v1/snapshots", tags=["snapshots"])
    async def list_snapshots(who: Auth, all_tenants: bool = False) -> dict[str, Any]:
        if all_tenants:
            require_admin(who, "list every tenant's snapshots")
        return {"snapshots": await gateway.snapshots.list(who, all_tenants)}

    @api.post("/v1/snapshots", status_code=201, tags=["snapshots"])
    async def snapshot_from_image(body: SnapshotFromImage, who: Auth) -> dict[str, Any]:
        """Built on a node, with the caller's registry lent to it for the pull."""
        node = gateway.membership.any_node()
        sent = body.model_dump(mode="json", exclude_unset=True)

        async def build(registry: str | None) -> dict[str, Any]:
            given = sent if registry is None else sent | {"registry": registry}
            made: dict[str, Any] = await node.json("POST", "/v1/snapshots", who, json=given)
            return made

        return await build_with(
            node, who, gateway.image_registries, body.registry, body.image, build
        )

    @api.post("/v1/snapshots/{snapshot_id}/fork", status_code=201, tags=["snapshots"])
    async def fork_snapshot(
        snapshot_id: str,
        body: ForkRequest,
        request: Request,
        who: Auth,
        idempotency_key: IdempotencyKey = None,
    ) -> dict[str, Any]:
        hint = request.headers.get(NODE_HINT)

        async def make() -> list[dict[str, Any]]:
            return await gateway.launcher.fork_snapshot(who, snapshot_id, body.count, prefer=hint)

        route = f"snapshots.fork:{snapshot_id}"
        return {"sandboxes": await once(who, route, idempotency_key, body, make)}

    @api.delete("/v1/snapshots/{snapshot_id}", status_code=204, tags=["snapshots"])
    async def delete_snapshot(snapshot_id: str, who: Auth) -> Response:
        await gateway.snapshots.delete(who, snapshot_id)
        return Response(status_code=204)

    @api.api_route("/v1/snapshots/{snapshot_id}/{rest:path}", methods=METHODS, tags=["snapshots"])
    @api.get("/v1/snapshots/{snapshot_id}", tags=["snapshots"])
    async def on_snapshot(
        request: Request, snapshot_id: str, who: Auth, rest: str = ""
    ) -> Response:
        return await forward(request, await gateway.snapshots.holder(who, snapshot_id), who)

    @api.get("/v1/secrets", response_model=SecretList, tags=["egress"])
    async def list_secrets(who: Auth) -> SecretList:
        rows = gateway.secrets.list(who.tenant)
        return SecretList(secrets=[Secret.model_validate(r) for r in rows])

    @api.get("/v1/secrets/{name}", response_model=Secret, tags=["egress"])
    async def get_secret(name: SecretName, who: Auth) -> Secret:
        return Secret.model_validate(gateway.secrets.get(who.tenant, name))

    @api.put("/v1/secrets/{name}", response_model=Secret, tags=["egress"])
    async def put_secret(name: SecretName, body: SecretPut, who: Auth) -> Secret:
        """Kept by the gateway and on every node (a sandbox may be placed on any)."""
        await gateway.secrets.put(who, name, body)
        return await get_secret(name, who)

    @api.delete("/v1/secrets/{name}", status_code=204, tags=["egress"])
    async def delete_secret(name: SecretName, who: Auth) -> Response:
        await gateway.secrets.delete(who, name)
        return Response(status_code=204)

    @api.post("/v1/secrets-key/rotate", response_model=KeyRotation, tags=["egress"])
    async def rotate_key(who: Auth) -> KeyRotation:
        """The gateway's secrets key and every node's, each sealing its own copy (admin)."""
        require_admin(who, "rotate the secrets key")
        return KeyRotation(resealed=await gateway.secrets.rotate_key())

    @api.post(
        "/v1/backups",
        response_class=StreamingResponse,
        responses={200: {"content": {"application/x-ndjson": {}}}},
        tags=["meta"],
    )
    async def backup(body: BackupRequest, who: Auth) -> StreamingResponse:
        """The gateway's own data directory (keys, sealed secrets, placements), written on
        its host; the sandboxes and snapshots are backed up on their nodes (admin)."""
        require_admin(who, "back up the gateway")
        start = partial(gateway.background.start, name="backup")
        return backup_stream(gateway.backups, body, start)

    @api.api_route("/v1/{rest:path}", methods=METHODS, include_in_schema=False)
    async def anywhere(rest: str, request: Request, who: Auth) -> Response:
        """Calls that are the same on every node (secrets read, templates, egress logs of the
        tenant): answered by one node."""
        return await forward(request, gateway.membership.any_node(), who)

    async def placed(ws: WebSocket, sandbox_id: str, tenant: str | None = None) -> Placed:
        who = bearer(ws, tenant)
        return await gateway.locator.node_of(who, sandbox_id), who

    # the relay accepts a socket once the node has accepted its own
    @api.websocket("/v1/sandboxes/{sandbox_id}/ports/{port}/connect")
    async def connect(ws: WebSocket, sandbox_id: str, port: int) -> None:
        found = await opened(ws, lambda: placed(ws, sandbox_id), accept=False)
        if found is not None:
            await relay_websocket(ws, *found)

    @api.websocket("/v1/sandboxes/{sandbox_id}/terminal")
    async def terminal(ws: WebSocket, sandbox_id: str) -> None:
        """The web console's terminal, relayed to the sandbox's node."""
        tenant = ws.query_params.get("tenant")
        found = await opened(
            ws, lambda: placed(ws, sandbox_id, tenant), accept=False, accept_refusal=True
        )
        if found is not None:
            await relay_websocket(ws, *found)

    @api.websocket("/v1/services/{sandbox_id}/{rest:path}")
    async def service_ws(ws: WebSocket, sandbox_id: str, rest: str) -> None:
        node = gateway.locator.serving(sandbox_id)
        if node is None:
            await ws.close(code=4404, reason=f"no service of sandbox {sandbox_id}")
            return
        await relay_websocket(ws, node, None, node_key=False)

    return api


async def _json(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError:
        raise errors.InvalidArgument("the body is not JSON") from None
    if not isinstance(body, dict):
        raise errors.InvalidArgument("the body must be a JSON object")
    return body
