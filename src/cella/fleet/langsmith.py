"""The LangSmith Sandboxes API on a fleet gateway: the node daemons serve it (their
`server/compat/langsmith`), the gateway places new boxes and relays every other call to the
node of the box it names (by name on the control plane, by id on the data plane). Registries
are the gateway's own (the same routes a node serves), lent to the node that builds."""

from __future__ import annotations

from typing import Any

import httpx2
from fastapi import APIRouter, FastAPI, Request, Response, WebSocket
from fastapi.responses import JSONResponse

from cella import errors
from cella.fleet.gateway import Gateway
from cella.fleet.launch import shape_of
from cella.fleet.node_client import Node
from cella.fleet.registries import build_with
from cella.fleet.relay import METHODS, NODE_HINT, forward, relay_websocket
from cella.server.compat.langsmith import registries
from cella.server.compat.langsmith.create import SNAPSHOT_FIELDS, read_create
from cella.server.compat.langsmith.proxy_config import rewrite_rules
from cella.server.compat.langsmith.shapes import DATAPLANE, ERROR_SHAPE, PREFIXES
from cella.server.deps import Caller, api_key_caller
from cella.server.error_shapes import add_error_shape

PAGE = 500  # what one node is asked for at most when the gateway pages a merged list


def install(app: FastAPI, gateway: Gateway) -> None:
    for prefix in PREFIXES:
        app.include_router(control(gateway, prefix))
        app.include_router(registries.router(prefix))  # the gateway's own (`Front`)
    app.include_router(dataplane(gateway))
    add_error_shape(app, ERROR_SHAPE)  # its SDK reads the same errors as from a node


def _rewrites(config: Any) -> dict[str, Any] | None:
    """A box's rewrite rules (its targets may be anywhere in the fleet), as cella's."""
    rules = config.get("rules") if isinstance(config, dict) else None
    if not isinstance(rules, list):
        return None
    found = [
        r.model_dump()
        for rule in rules
        if isinstance(rule, dict)
        and rule.get("type") == "rewrite"
        and rule.get("enabled") is not False
        for r in rewrite_rules(rule)
    ]
    return {"rewrites": found} if found else None


def control(gateway: Gateway, prefix: str) -> APIRouter:
    api = APIRouter(prefix=prefix, include_in_schema=False)

    @api.post("/boxes")
    async def create_box(request: Request, who: Caller) -> Response:
        body = await request.json()
        if not isinstance(body, dict):
            raise errors.InvalidArgument("the body must be a JSON object")
        box = read_create(body)  # as the node will read it: the same name, size, snapshot
        body = {k: v for k, v in body.items() if k not in SNAPSHOT_FIELDS} | {"name": box.name}
        answer: httpx2.Response | None = None
        grant = gateway.delegations.ask(who, box.spec().access_delegation)
        rewrites = await gateway.rewrites.settle(who, _rewrites(body.get("proxy_config")))
        headers = _host(request) | ({} if grant is None else gateway.delegations.header(grant))

        async def make(node: Node, n: int, snapshot_id: str | None) -> list[dict[str, Any]]:
            nonlocal answer
            sent = body if snapshot_id is None else body | {"snapshot_id": snapshot_id}
            answer = await node.call(
                "POST",
                request.url.path,
                who,
                langsmith=True,
                json=sent,
                params=request.query_params,
                headers=headers,
            )
            if not answer.is_success:  # refused by the node: relayed as it said it
                return []
            made = answer.json()
            if grant is not None:
                gateway.delegations.made(made["id"], who.tenant, grant)
            gateway.rewrites.record(made["id"], who, rewrites)
            return [await node.json("GET", f"/v1/sandboxes/{made['id']}", who)]

        source = box.snapshot or shape_of(box.spec())
        hint = request.headers.get(NODE_HINT)
        await gateway.launcher.launch(who, 1, source, make, name=box.name, prefer=hint)
        assert answer is not None  # made once, or launching raised
        return Response(
            answer.content,
            status_code=answer.status_code,
            media_type=answer.headers.get("content-type"),
        )

    @api.get("/boxes")
    async def list_boxes(request: Request, who: Caller) -> Response:
        found: list[dict[str, Any]] = []
        for node in gateway.membership.healthy():
            answer = await node.call(
                "GET", request.url.path, who, langsmith=True, headers=_host(request)
            )
            if not answer.is_success:
                return _relay(answer)
            found += answer.json()["sandboxes"]
        return JSONResponse({"sandboxes": sorted(found, key=lambda b: str(b.get("created_at")))})

    @api.api_route("/boxes/{name}", methods=METHODS)
    @api.api_route("/boxes/{name}/{rest:path}", methods=METHODS)
    async def on_box(name: str, request: Request, who: Caller) -> Response:
        where = await gateway.locator.placement_named(who, name)
        changed = request.method == "PATCH" and request.url.path.endswith(f"/boxes/{name}")
        try:
            body = await request.json() if changed else None  # (relayed as read)
        except ValueError:
            raise errors.InvalidArgument("the body is not JSON") from None
        changes = isinstance(body, dict) and "proxy_config" in body
        rules = None
        if isinstance(body, dict) and changes:  # its rewrites decided here, as on a create
            rules = await gateway.rewrites.settle(who, _rewrites(body["proxy_config"]))
        answer = await forward(request, gateway.locator.usable(where), who, langsmith=True)
        if changes and answer.status_code < 300:
            gateway.rewrites.record(where.sandbox_id, who, rules)
        if request.method == "DELETE" and answer.status_code < 300:
            gateway.locator.deleted(where.sandbox_id)
        if request.url.path.endswith(f"/boxes/{name}/start") and answer.status_code < 300:
            gateway.locator.woken(where.sandbox_id)
        return answer

    @api.get("/snapshots")
    async def list_snapshots(
        request: Request, who: Caller, offset: int = 0, limit: int = 50
    ) -> Response:
        seen: dict[str, dict[str, Any]] = {}
        params = {**request.query_params, "offset": "0", "limit": str(PAGE)}
        for node in gateway.membership.healthy():
            answer = await node.call("GET", request.url.path, who, langsmith=True, params=params)
            if not answer.is_success:
                return _relay(answer)
            for snap in answer.json()["snapshots"]:
                seen.setdefault(snap["id"], snap)
        ordered = sorted(seen.values(), key=lambda s: str(s.get("created_at")))
        return JSONResponse({"snapshots": ordered[offset : offset + limit], "offset": offset})

    @api.api_route("/snapshots/{ref:path}", methods=["GET", "DELETE"])
    @api.get("/snapshots-by-name/{ref:path}")
    async def on_snapshot(ref: str, request: Request, who: Caller) -> Response:
        """Answered by the nodes that hold it (a delete removes every copy)."""
        answers = []
        for node in gateway.membership.healthy():
            answer = await node.call(
                request.method, request.url.path, who, langsmith=True, headers=_host(request)
            )
            if answer.status_code != 404:
                answers.append(answer)
                if request.method == "GET":
                    break
        if not answers:
            raise errors.NotFound(f"Snapshot '{ref}' not found")
        failed = [a for a in answers if not a.is_success]
        return _relay(failed[0] if failed else answers[0])

    @api.post("/snapshots")
    async def build_snapshot(request: Request, who: Caller) -> Response:
        """Built on a node, with the caller's registry (`registry_id`) lent to it."""
        body = await request.json()
        if not isinstance(body, dict):
            raise errors.InvalidArgument("the body must be a JSON object")
        node = gateway.membership.any_node()
        registry = None if body.get("registry_id") is None else str(body["registry_id"])
        if registry is not None:
            try:
                gateway.image_registries.get(who.tenant, registry)
            except errors.NotFound:
                raise errors.NotFound(f"Registry '{registry}' not found") from None

        async def build(lent: str | None) -> httpx2.Response:
            sent = body if lent is None else body | {"registry_id": lent}
            return await node.call(
                "POST", request.url.path, who, langsmith=True, json=sent, headers=_host(request)
            )

        image = str(body.get("docker_image") or "")
        return _relay(await build_with(node, who, gateway.image_registries, registry, image, build))

    return api


def dataplane(gateway: Gateway) -> APIRouter:
    api = APIRouter(prefix=DATAPLANE + "/{sandbox_id}", include_in_schema=False)

    @api.api_route("/{rest:path}", methods=METHODS)
    async def on_sandbox(sandbox_id: str, request: Request, who: Caller) -> Response:
        return await forward(
            request, await gateway.locator.node_of(who, sandbox_id), who, langsmith=True
        )

    @api.websocket("/{rest:path}")
    async def on_socket(ws: WebSocket, sandbox_id: str) -> None:
        try:
            who = api_key_caller(ws, ws.headers.get("x-api-key"), ws.headers.get("x-cella-tenant"))
            node = await gateway.locator.node_of(who, sandbox_id)
        except errors.CellaError as exc:
            await ws.close(code=4000 + (exc.status if exc.status < 1000 else 500))
            return
        await relay_websocket(ws, node, who, langsmith=True)

    return api


def _host(request: Request) -> dict[str, str]:
    """The caller's Host and scheme: URLs a node builds (data plane, service URLs) name the
    gateway as its callers reach it."""
    return {"host": request.headers.get("host", ""), "x-forwarded-proto": request.url.scheme}


def _relay(answer: Any) -> Response:
    """A node's answer, as it gave it."""
    media = answer.headers.get("content-type") if answer.content else None
    return Response(answer.content, status_code=answer.status_code, media_type=media)
