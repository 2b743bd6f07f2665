"""E2B's volumes, named templates (its v3 build API) and webhooks on the gateway, through
the rooms cella's own routes use: a volume on its home node (`fleet/volumes.py`, its content
API reached with the volume's own token), a named template on its home node
(`fleet/named_templates.py`), webhooks kept here and on every node
(`fleet/shared_webhooks.py`, in E2B's form). Lists are merged from every node."""

from __future__ import annotations

import re
from typing import Annotated, Any

from fastapi import APIRouter, Body, FastAPI, Request, Response
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from cella import errors
from cella.fleet.gateway import Gateway
from cella.fleet.relay import METHODS, forward
from cella.models import WebhookCreate, WebhookUpdate
from cella.models.volumes import VOLUME_NAME
from cella.server.compat.e2b.observe import FIELDS, cella_fields, webhook_json
from cella.server.compat.e2b.shapes import ERROR_SHAPE
from cella.server.deps import Caller
from cella.server.error_shapes import add_error_shape, describe, shapes

Json = dict[str, Any]
JsonBody = Annotated[Json, Body()]


def install(app: FastAPI, gateway: Gateway) -> None:
    app.include_router(router(gateway))
    if ERROR_SHAPE not in shapes(app):  # E2B's error body on its paths
        add_error_shape(app, ERROR_SHAPE)


def router(gateway: Gateway) -> APIRouter:
    api = APIRouter(include_in_schema=False)
    volumes, named, hooks = gateway.volumes, gateway.template_homes, gateway.webhooks

    async def on(request: Request, node: Any, who: Any) -> Response:
        return await forward(request, node, who, langsmith=True)  # E2B's key header

    # -- volumes ------------------------------------------------------------------------------

    @api.post("/volumes", status_code=201)
    async def create_volume(who: Caller, body: JsonBody) -> Response:
        name = body.get("name")
        if not isinstance(name, str) or not re.match(VOLUME_NAME, name):
            raise errors.InvalidArgument("Invalid volume name (letters, digits, '_' and '-')")
        try:
            answer = await volumes.create(who, name, lambda n: n.call(
                "POST", "/volumes", who, langsmith=True, json={"name": name}))  # fmt: skip
        except errors.AlreadyExists:
            raise errors.InvalidArgument(f"Volume with name '{name}' already exists") from None
        return Response(answer.content, answer.status_code, media_type="application/json")

    @api.get("/volumes")
    async def list_volumes(who: Caller) -> list[Json]:
        listed = await volumes.listed(who)
        return [{"volumeID": v["id"], "name": v["name"]} for v in listed["volumes"]]

    @api.api_route("/volumes/{volume_id}", methods=["GET", "DELETE"])
    async def on_volume(volume_id: str, request: Request, who: Caller) -> Response:
        home, node = await volumes.home(who, volume_id)
        answer = await on(request, node, who)
        if request.method == "DELETE" and answer.status_code < 300:
            volumes.forget(home)
        return answer

    @api.api_route("/volumecontent/{volume_id}/{rest:path}", methods=METHODS)
    async def volume_content(volume_id: str, rest: str, request: Request) -> Response:
        """The volume's own token (its bearer, carried as is) authenticates it, on its home
        node."""
        token = {"authorization": request.headers.get("authorization", "")}
        node = volumes.home_by_id(volume_id)
        return await forward(request, node, None, node_key=False, extra=token)

    # -- named templates (E2B's build API) ---------------------------------------------------

    @api.post("/v3/templates", status_code=202)
    async def request_build(request: Request, who: Caller, body: JsonBody) -> Response:
        """On the template's home, or (a new name) the node home to the fewest."""
        name = body.get("name") or body.get("alias")
        if not isinstance(name, str) or not name:
            raise errors.InvalidArgument("name is required")
        node = named.where_new(who, name)
        answer = await node.call("POST", "/v3/templates", who, langsmith=True, json=body)
        if answer.is_success:
            named.record(who, str(answer.json()["templateID"]), name, node)
        return Response(answer.content, answer.status_code, media_type="application/json")

    @api.get("/v2/templates")
    @api.get("/templates")
    async def list_templates(who: Caller) -> JSONResponse:
        found: list[Json] = []
        for node, listed in await gateway.membership.each("GET", "/templates", who, langsmith=True):
            for t in listed:
                names = t.get("names") or t.get("aliases") or []
                if names:
                    named.record(who, str(t["templateID"]), str(names[0]), node)
                found.append(t)
        return JSONResponse(found)

    @api.post("/templates/tags", status_code=201)
    @api.delete("/templates/tags", status_code=204)
    async def tags(request: Request, who: Caller, body: JsonBody) -> Response:
        """By the template that `target` (name:tag) or `name` names, on its home."""
        ref = body.get("target") if request.method == "POST" else body.get("name")
        if not isinstance(ref, str) or not ref:
            raise errors.InvalidArgument("target (name:tag) and tags are required")
        node = await named.node_of(who, ref.partition(":")[0])
        answer = await node.call(request.method, "/templates/tags", who, langsmith=True,
                                 json=body)  # fmt: skip
        return Response(answer.content, answer.status_code, media_type="application/json")

    @api.get("/templates/aliases/{alias}")
    async def alias(alias: str, request: Request, who: Caller) -> Response:
        return await on(request, await named.node_of(who, alias), who)

    @api.api_route("/templates/{template_id}/{rest:path}", methods=["GET"])
    @api.api_route("/v2/templates/{template_id}/{rest:path}", methods=["GET", "POST"])
    async def on_template(template_id: str, rest: str, request: Request, who: Caller) -> Response:
        """Its upload links, builds, status, logs and tags: on its home node."""
        return await on(request, await named.node_of(who, template_id), who)

    @api.get("/templates/{template_id}")
    async def get_template(template_id: str, request: Request, who: Caller) -> Response:
        return await on(request, await named.node_of(who, template_id), who)

    @api.delete("/templates/{ref:path}")
    async def delete_template(ref: str, request: Request, who: Caller) -> Response:
        """A named template on its home; else a snapshot (E2B deletes snapshots as
        templates), on the node that holds it."""
        if named.known(who, ref):
            answer = await on(request, await named.node_of(who, ref), who)
            if answer.status_code < 300:
                named.forget(who, ref)
            return answer
        return await on(request, await gateway.snapshots.holder(who, ref), who)

    # -- webhooks (E2B's form) ------------------------------------------------------------------

    @api.post("/events/webhooks", status_code=201)
    async def create_webhook(who: Caller, body: JsonBody) -> Json:
        try:
            spec = WebhookCreate.model_validate(cella_fields(body, FIELDS))
        except ValidationError as exc:
            raise errors.InvalidArgument(describe(exc.errors())) from None
        return webhook_json(await hooks.create(who, spec, flavor="e2b"))

    @api.get("/events/webhooks")
    async def list_webhooks(who: Caller) -> list[Json]:
        return [webhook_json(h) for h in hooks.all(who)]

    @api.get("/events/webhooks/{webhook_id}")
    async def get_webhook(webhook_id: str, who: Caller) -> Json:
        return webhook_json(hooks.get(who, webhook_id))

    @api.patch("/events/webhooks/{webhook_id}")
    async def update_webhook(webhook_id: str, who: Caller, body: JsonBody) -> Json:
        try:
            spec = WebhookUpdate.model_validate(cella_fields(body, FIELDS))
        except ValidationError as exc:
            raise errors.InvalidArgument(describe(exc.errors())) from None
        return webhook_json(await hooks.update(who, webhook_id, spec))

    @api.delete("/events/webhooks/{webhook_id}")
    async def delete_webhook(webhook_id: str, who: Caller) -> Response:
        await hooks.delete(who, webhook_id)
        return Response(status_code=200)

    return api
