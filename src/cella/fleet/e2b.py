"""E2B's API on a fleet gateway, so that E2B's SDK drives a fleet unchanged: the node
daemons serve it (their `server/compat/e2b`); the gateway places new sandboxes and forks
(`Launcher`), merges lists (sandboxes, snapshots, metrics) from every node with E2B's
filters and pages, relays every other call on a sandbox to its node and envd's traffic too
(`e2b_envd`). The sandboxes it answers name the gateway's domain (`get_host`)."""

from __future__ import annotations

import asyncio
import base64
import re
from typing import Any

import httpx2
from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import JSONResponse

from cella import errors
from cella.fleet import e2b_envd, e2b_secrets
from cella.fleet.gateway import Gateway
from cella.fleet.node_client import Node
from cella.fleet.planner import Shape
from cella.fleet.relay import METHODS, NODE_HINT, forward
from cella.models import SandboxCreate
from cella.server.compat.e2b import envd
from cella.server.compat.e2b.control import MAX_FORKS, TEMPLATES, int_param, page_start
from cella.server.compat.e2b.observe import asked_ids
from cella.server.compat.e2b.shapes import BASE, ERROR_SHAPE
from cella.server.deps import Caller
from cella.server.error_shapes import ErrorShape, shapes
from cella.service.keys import Principal

Json = dict[str, Any]
PAGE = 500  # what one node is asked for at most while the gateway pages a merged list
SNAPSHOT_REF = re.compile(r"^(?!\.{1,2}$)[A-Za-z0-9._:-]{1,200}$")  # an id, name or name:tag


def install(app: FastAPI, gateway: Gateway) -> None:
    app.include_router(control(gateway))
    app.include_router(e2b_secrets.router(gateway))
    e2b_envd.install(app, gateway)
    # first: E2B's /v2/sandboxes and /v2/sandboxes/{id}/connect lie under LangSmith's prefix
    shapes(app)[0:0] = [ErrorShape(envd.owns, envd.error_response), ERROR_SHAPE]


def control(gateway: Gateway) -> APIRouter:
    api = APIRouter(include_in_schema=False)
    domain = gateway.settings.ports_domain

    async def node_of(who: Principal, sandbox_id: str) -> Node:
        try:
            return await gateway.locator.node_of(who, sandbox_id)
        except errors.NotFound:
            raise errors.NotFound(f"sandbox {sandbox_id} not found") from None

    @api.post("/v2/sandboxes", status_code=201)
    @api.post("/sandboxes", status_code=201)
    async def create(request: Request, who: Caller) -> Response:
        """Placed as cella's creates are: from its template's shape, or from the snapshot
        its `templateID` names (shipped to the node chosen if that lacks it)."""
        body = await _object(request)
        source = await _source(gateway, who, str(body.get("templateID") or BASE))
        answer: httpx2.Response | None = None

        async def make(node: Node, n: int, snapshot_id: str | None) -> list[Json]:
            nonlocal answer
            sent = body if snapshot_id is None else body | {"templateID": snapshot_id}
            answer = await node.call("POST", request.url.path, who, langsmith=True, json=sent)
            if not answer.is_success:  # refused by the node: relayed as it said it
                return []
            made = answer.json()["sandboxID"]
            return [await node.json("GET", f"/v1/sandboxes/{made}", who)]

        hint = request.headers.get(NODE_HINT)
        await gateway.launcher.launch(who, 1, source, make, prefer=hint)
        assert answer is not None  # made once, or launching raised
        return _named(answer, domain)

    @api.get("/v2/sandboxes")
    @api.get("/sandboxes")
    async def list_sandboxes(request: Request, who: Caller) -> Response:
        """Every node's, filtered there, then ordered by start and paged here."""
        q = request.query_params
        found = await _merged(gateway, who, request)
        if isinstance(found, Response):
            return found
        found.sort(key=lambda s: str(s.get("startedAt")), reverse=q.get("order") == "desc")
        return _page(found, q.get("nextToken"), q.get("limit"))

    @api.get("/sandboxes/metrics")
    async def many_metrics(request: Request, who: Caller) -> Response:
        """Each node asked for the latest of its own sandboxes among those named."""
        ids = asked_ids(request)
        by_node: dict[str, list[str]] = {}
        for sandbox_id in ids:
            where = gateway.placements.get(sandbox_id)
            if where is not None and where.tenant == who.tenant and not where.lost:
                by_node.setdefault(where.node, []).append(sandbox_id)
        merged: Json = {}
        for name, held in by_node.items():
            node = gateway.membership.up(name)
            if node is None:
                continue
            params = {"sandbox_ids": ",".join(held)}
            answer = await node.call("GET", request.url.path, who, langsmith=True, params=params)
            if not answer.is_success:
                return _relay(answer)
            merged |= answer.json().get("sandboxes") or {}
        return JSONResponse({"sandboxes": merged})

    @api.api_route("/sandboxes/{sandbox_id}", methods=["GET", "DELETE"])
    async def on_sandbox(sandbox_id: str, request: Request, who: Caller) -> Response:
        if request.method == "DELETE":
            return await kill(sandbox_id, request, who)
        node = await node_of(who, sandbox_id)
        return _named(await node.call("GET", request.url.path, who, langsmith=True), domain)

    async def kill(sandbox_id: str, request: Request, who: Caller) -> Response:
        try:
            where = await gateway.locator.placement(who, sandbox_id)
        except errors.NotFound:
            raise errors.NotFound(f"sandbox {sandbox_id} not found") from None
        if where.lost:  # nothing is left of it to kill: forgotten
            gateway.locator.forget(sandbox_id)
            return Response(status_code=204)
        answer = await forward(request, gateway.locator.usable(where), who, langsmith=True)
        if answer.status_code < 300:
            gateway.locator.deleted(sandbox_id)
        return answer

    @api.post("/v2/sandboxes/{sandbox_id}/connect")
    @api.post("/sandboxes/{sandbox_id}/connect")
    @api.post("/sandboxes/{sandbox_id}/resume")
    async def connect(sandbox_id: str, request: Request, who: Caller) -> Response:
        """Resumed on its node (where its memory is), with the gateway's domain."""
        node = await node_of(who, sandbox_id)
        body = await request.body()
        headers = {"content-type": "application/json"} if body else {}
        answer = await node.call(
            "POST", request.url.path, who, langsmith=True, content=body, headers=headers
        )
        if answer.is_success:
            gateway.locator.woken(sandbox_id)
        return _named(answer, domain)

    @api.post("/sandboxes/{sandbox_id}/fork", status_code=201)
    async def fork(sandbox_id: str, request: Request, who: Caller) -> Response:
        """Forks of a snapshot of it, placed across the fleet as cella's forks are."""
        body = await _object(request, empty=True)
        count = int_param(body.get("count"), 1, "count")
        if not 1 <= count <= MAX_FORKS:
            raise errors.InvalidArgument(f"count must be 1-{MAX_FORKS}, got {count}")
        await node_of(who, sandbox_id)
        hint = request.headers.get(NODE_HINT)
        made = await gateway.launcher.fork_sandbox(who, sandbox_id, count, hint)
        shown = []
        for child in made:
            node = await node_of(who, child["id"])
            if body.get("timeout") is not None:
                path = f"/sandboxes/{child['id']}/timeout"
                sent = {"timeout": body["timeout"]}
                answer = await node.call("POST", path, who, langsmith=True, json=sent)
                if not answer.is_success:
                    return _relay(answer)
            # connecting to a running sandbox changes nothing: it answers E2B's Sandbox
            answer = await node.call("POST", f"/sandboxes/{child['id']}/connect", who,
                                     langsmith=True, json={})  # fmt: skip
            if not answer.is_success:
                return _relay(answer)
            shown.append({"sandbox": answer.json() | {"domain": domain}})
        return JSONResponse(shown, status_code=201)

    @api.api_route("/v2/sandboxes/{sandbox_id}/logs", methods=["GET"])
    @api.api_route("/sandboxes/{sandbox_id}/{rest:path}", methods=METHODS)
    async def on_sandbox_part(sandbox_id: str, request: Request, who: Caller) -> Response:
        """Every other call on a sandbox (timeout, refreshes, network, pause, snapshots,
        metrics, logs), streamed to its node."""
        return await forward(request, await node_of(who, sandbox_id), who, langsmith=True)

    @api.get("/snapshots")
    async def list_snapshots(request: Request, who: Caller) -> Response:
        """Every node's (a snapshot shipped to several is listed once), paged here."""
        q = request.query_params
        found = await _merged(gateway, who, request)
        if isinstance(found, Response):
            return found
        seen: dict[str, Json] = {}
        for snap in found:
            seen.setdefault(str(snap.get("snapshotID")), snap)
        return _page(list(seen.values()), q.get("nextToken"), q.get("limit"))

    return api


async def _source(gateway: Gateway, who: Principal, template: str) -> Shape | str:
    """What a create boots from, as the planner reads it: a snapshot's id (E2B creates
    from a snapshot by naming it as the template), else the template's shape (the node
    decides what the name means)."""
    if template not in TEMPLATES and SNAPSHOT_REF.match(template):
        try:
            snap, _ = await gateway.snapshots.resolve(who, template)
            return str(snap["id"])
        except errors.NotFound:
            pass
    fields = SandboxCreate.model_fields
    return Shape(fields["vcpus"].default, fields["memory_mib"].default,
                 TEMPLATES.get(template, template))  # fmt: skip


async def _merged(gateway: Gateway, who: Principal, request: Request) -> list[Json] | Response:
    """The same list call on every healthy node, each followed through its pages (or the
    first refusal, relayed)."""
    kept = [(k, v) for k, v in request.query_params.multi_items()
            if k not in ("limit", "nextToken")]  # fmt: skip

    async def pages(node: Node) -> list[Json] | httpx2.Response:
        found: list[Json] = []
        token = None
        while True:
            params = [*kept, ("limit", str(PAGE)), *([("nextToken", token)] if token else [])]
            answer = await node.call("GET", request.url.path, who, langsmith=True, params=params)
            if not answer.is_success:
                return answer
            try:
                page = answer.json()
            except ValueError:
                page = None
            if not isinstance(page, list):
                raise errors.NodeUnavailable(f"node {node.name} answered no E2B list")
            found += page
            token = answer.headers.get("x-next-token")
            if not token:
                return found

    answers = await asyncio.gather(*(pages(n) for n in gateway.membership.healthy()))
    merged: list[Json] = []
    for answer in answers:
        if isinstance(answer, httpx2.Response):
            return _relay(answer)
        merged += answer
    return merged


def _page(items: list[Json], token: str | None, limit: str | None) -> Response:
    """One page of a merged list, with E2B's `X-Next-Token` when more follow."""
    start = page_start(token)
    size = int_param(limit, 100, "limit")
    if size < 1:
        raise errors.InvalidArgument("limit must be at least 1")
    headers = {}
    if start + size < len(items):
        headers["X-Next-Token"] = base64.urlsafe_b64encode(str(start + size).encode()).decode()
    return JSONResponse(items[start : start + size], headers=headers)


async def _object(request: Request, *, empty: bool = False) -> Json:
    raw = await request.body()
    if empty and not raw.strip():
        return {}
    try:
        body = await request.json()
    except ValueError:
        raise errors.InvalidArgument("the body is not JSON") from None
    if body is None and empty:
        return {}
    if not isinstance(body, dict):
        raise errors.InvalidArgument("the body must be a JSON object")
    return body


def _named(answer: httpx2.Response, domain: str) -> Response:
    """A node's answer holding a sandbox, which names the gateway's domain instead of the
    node's: what `get_host` builds must reach the gateway."""
    if not answer.is_success:
        return _relay(answer)
    body = answer.json()
    if isinstance(body, dict) and "domain" in body:
        body["domain"] = domain
    return JSONResponse(body, status_code=answer.status_code)


def _relay(answer: httpx2.Response) -> Response:
    """A node's answer, as it gave it."""
    media = answer.headers.get("content-type") if answer.content else None
    return Response(answer.content, status_code=answer.status_code, media_type=media)
