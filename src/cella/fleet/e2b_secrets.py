"""E2B's secrets API (`/secrets`) on a fleet gateway: the fleet's tenant secrets
(`SharedSecrets`: kept by the gateway and on every node, where sandboxes' header rules
name them), in E2B's shapes and names as a node serves them (`server/compat/e2b/secrets`).
No answer carries a value."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response

from cella import errors
from cella.fleet.gateway import Gateway
from cella.server.compat.e2b.control import JsonBody
from cella.server.compat.e2b.secrets import (
    new_name,
    next_version,
    page,
    secret_json,
    secret_name,
    secret_put,
)
from cella.server.deps import Caller


def router(gateway: Gateway) -> APIRouter:
    api = APIRouter(include_in_schema=False)
    secrets = gateway.secrets

    @api.get("/secrets")
    async def list_secrets(request: Request, who: Caller) -> Response:
        q = request.query_params
        return page(secrets.list(who.tenant), q.get("nextToken"), q.get("limit"))

    @api.post("/secrets", status_code=201)
    async def create_secret(body: JsonBody, who: Caller) -> dict[str, Any]:
        name = new_name(body.get("name"))
        put = secret_put(body)
        if any(r.name == name for r in secrets.list(who.tenant)):
            raise errors.AlreadyExists(f"secret {name!r} exists")
        await secrets.put(who, name, put)
        return secret_json(secrets.get(who.tenant, name))

    @api.get("/secrets/{ref}")
    async def get_secret(ref: str, who: Caller) -> dict[str, Any]:
        return secret_json(secrets.get(who.tenant, secret_name(ref)))

    @api.post("/secrets/{ref}")
    async def update_secret(ref: str, body: JsonBody, who: Caller) -> dict[str, Any]:
        """A new version of the value (and the metadata, when given), on every node."""
        name = secret_name(ref)
        await secrets.put(who, name, next_version(secrets.get(who.tenant, name), body))
        return secret_json(secrets.get(who.tenant, name))

    @api.delete("/secrets/{ref}", status_code=204)
    async def delete_secret(ref: str, who: Caller) -> Response:
        await secrets.delete(who, secret_name(ref))
        return Response(status_code=204)

    return api
