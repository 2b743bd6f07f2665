"""The gateway's cella routes for what nodes share: volumes (on their home node,
`fleet/volumes.py`), webhooks (kept here and on every node, `fleet/shared_webhooks.py`) and
templates (built once, shipped by digest to the nodes that need them:
`fleet/templates.py`). Installed before the gateway's
catch-all, which would send them to any one node."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Annotated, Any

import httpx2
from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from cella import errors
from cella.fleet.gateway import Gateway
from cella.fleet.node_client import Node
from cella.fleet.relay import METHODS, NODE_HINT, forward
from cella.models import (
    TemplateBuild,
    Volume,
    VolumeCreate,
    Webhook,
    WebhookCreate,
    WebhookCreated,
    WebhookList,
    WebhookUpdate,
)
from cella.models.fleet import TemplateShip
from cella.server.deps import Auth
from cella.server.error_shapes import describe
from cella.server.routes.templates import spool_body
from cella.service.keys import require_admin

NDJSON = "application/x-ndjson"


def relayed(answer: httpx2.Response) -> Response:
    """A node's answer as the gateway's."""
    kind = answer.headers.get("content-type", "application/json")
    return Response(answer.content, answer.status_code, media_type=kind)


def router(gateway: Gateway) -> APIRouter:
    api = APIRouter()
    volumes, hooks, templates = gateway.volumes, gateway.webhooks, gateway.templates

    # -- volumes ------------------------------------------------------------------------------

    @api.post("/v1/volumes", status_code=201, response_model=Volume, tags=["volumes"])
    async def create_volume(body: VolumeCreate, who: Auth) -> Response:
        """Made on one node, its home: sandboxes that mount it are placed there."""
        sent = body.model_dump()

        def make(node: Node) -> Awaitable[httpx2.Response]:
            return node.call("POST", "/v1/volumes", who, json=sent)

        return relayed(await volumes.create(who, body.name, make))

    @api.get("/v1/volumes", tags=["volumes"])
    async def list_volumes(who: Auth) -> dict[str, Any]:
        return await volumes.listed(who)

    @api.api_route("/v1/volumes/{key}", methods=["GET", "DELETE"], tags=["volumes"])
    async def on_volume(key: str, request: Request, who: Auth) -> Response:
        home, node = await volumes.home(who, key)
        answer = await forward(request, node, who)
        if request.method == "DELETE" and answer.status_code < 300:
            volumes.forget(home)
        return answer

    @api.api_route("/v1/volumes/{key}/{rest:path}", methods=METHODS, tags=["volumes"])
    async def volume_content(key: str, rest: str, request: Request, who: Auth) -> Response:
        """Its content API, on its home node."""
        _, node = await volumes.home(who, key)
        return await forward(request, node, who)

    # -- webhooks ------------------------------------------------------------------------------

    @api.post("/v1/webhooks", status_code=201, response_model=WebhookCreated, tags=["webhooks"])
    async def create_webhook(body: WebhookCreate, who: Auth) -> WebhookCreated:
        """Kept here and put on every node (a sandbox may be placed on any), with one id and
        secret; a URL a node holds outside its boundary is refused."""
        hook = await hooks.create(who, body)
        return WebhookCreated.model_validate(hook, from_attributes=True)

    @api.get("/v1/webhooks", response_model=WebhookList, tags=["webhooks"])
    async def list_webhooks(who: Auth) -> WebhookList:
        return WebhookList(webhooks=[Webhook.model_validate(h) for h in hooks.all(who)])

    @api.get("/v1/webhooks/{webhook_id}", response_model=Webhook, tags=["webhooks"])
    async def get_webhook(webhook_id: str, who: Auth) -> Webhook:
        return Webhook.model_validate(hooks.get(who, webhook_id))

    @api.patch("/v1/webhooks/{webhook_id}", response_model=Webhook, tags=["webhooks"])
    async def update_webhook(webhook_id: str, body: WebhookUpdate, who: Auth) -> Webhook:
        return Webhook.model_validate(await hooks.update(who, webhook_id, body))

    @api.delete("/v1/webhooks/{webhook_id}", status_code=204, tags=["webhooks"])
    async def delete_webhook(webhook_id: str, who: Auth) -> Response:
        await hooks.delete(who, webhook_id)
        return Response(status_code=204)

    @api.get("/v1/webhooks/{webhook_id}/deliveries", tags=["webhooks"])
    async def list_deliveries(
        webhook_id: str,
        who: Auth,
        after: Annotated[int, Query(ge=0, description="deliveries after this id (per node)")] = 0,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    ) -> dict[str, Any]:
        """Every node's deliveries of the webhook, oldest first, each naming its node."""
        return {"deliveries": await hooks.deliveries(who, webhook_id, after, limit)}

    # -- templates -----------------------------------------------------------------------------

    @api.get("/v1/templates", tags=["templates"])
    async def list_templates(who: Auth) -> dict[str, Any]:
        return {"templates": await templates.listed(None if who.admin else who.tenant)}

    @api.get("/v1/templates/{name}", tags=["templates"])
    async def get_template(name: str, who: Auth) -> Any:
        for template in await templates.listed(None if who.admin else who.tenant):
            if template["name"] == name:
                return template
        raise errors.NotFound(f"no template {name!r}")

    @api.post("/v1/templates", tags=["templates"])
    async def build_template(request: Request, who: Auth) -> StreamingResponse:
        """Built once, on one node (`X-Cella-Node`, else the first; progress lines name
        it); shipped by digest to the nodes its sandboxes are placed on, and to nodes that
        join later."""
        require_admin(who, "build templates")
        try:
            body = TemplateBuild.model_validate(await request.json())
        except ValidationError as exc:
            raise errors.InvalidArgument(describe(exc.errors())) from None
        except ValueError:
            raise errors.InvalidArgument("the body is not JSON") from None
        prefer = request.headers.get(NODE_HINT)
        return StreamingResponse(templates.build_image(body, prefer), media_type=NDJSON)

    @api.post("/v1/templates/{name}/dockerfile", tags=["templates"])
    async def build_dockerfile(name: str, request: Request, who: Auth) -> StreamingResponse:
        """Built once, on one node, from the context (spooled here first)."""
        require_admin(who, "build templates")
        spool = await spool_body(request, gateway.settings.max_upload_mib << 20)
        prefer = request.headers.get(NODE_HINT)
        built = templates.build_dockerfile(name, request.url.query, spool, prefer)
        return StreamingResponse(built, media_type=NDJSON)

    @api.post("/v1/templates/{name}/ship", tags=["templates"])
    async def ship_template(name: str, body: TemplateShip, who: Auth) -> dict[str, Any]:
        """Shipped ahead of time to `nodes` (default: every healthy node) that lack it,
        each copy checked against the template's digest on arrival."""
        require_admin(who, "ship templates")
        return {"nodes": await templates.ship_ahead(name, body.nodes)}

    @api.put("/v1/templates/uploads/{template_id}/{files_hash}", include_in_schema=False)
    async def upload_files(template_id: str, files_hash: str, request: Request) -> Response:
        """A signed upload link of a named template's build: its own token, on its node."""
        return await forward(request, gateway.template_homes.node_by_id(template_id), None,
                             node_key=False)  # fmt: skip

    @api.delete("/v1/templates/{name}", status_code=204, tags=["templates"])
    async def delete_template(name: str, who: Auth) -> Response:
        require_admin(who, "remove templates")
        await templates.delete(name)
        return Response(status_code=204)

    return api
