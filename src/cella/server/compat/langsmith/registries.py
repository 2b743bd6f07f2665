"""LangSmith's sandbox registries (`client.registries`: create, list, retrieve, update,
delete; addressed by name) as cella's image registries. Credentials are kept sealed and
never returned; `auth_type` DOCKER_CONFIG (user and password) is what cella does. Served
by a node daemon and by a fleet gateway alike (`Front.image_registries`)."""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Body, Query, Response
from pydantic import ValidationError

from cella import errors
from cella.models import RegistryCreate, RegistryUpdate
from cella.server.compat.langsmith.shapes import iso, not_supported
from cella.server.deps import Caller, FrontDep
from cella.server.error_shapes import describe
from cella.server.front import Front
from cella.store import RegistryRecord

Json = dict[str, Any]
JsonBody = Annotated[dict[str, Any], Body()]
M = TypeVar("M", RegistryCreate, RegistryUpdate)
FIELDS = {"name", "url", "username", "password", "auth_type", "aws_role_arn"}


def router(prefix: str) -> APIRouter:
    api = APIRouter(prefix=prefix, include_in_schema=False)

    @api.post("/registries", status_code=201)
    async def create(svc: FrontDep, who: Caller, body: JsonBody) -> Json:
        req = _read(RegistryCreate, body)
        return registry_json(svc.image_registries.create(who.tenant, req))

    @api.get("/registries")
    async def list_all(
        svc: FrontDep,
        who: Caller,
        name_contains: str | None = None,
        cursor: str | None = None,
        page_size: int | None = Query(default=None, ge=1, le=100),
        limit: int | None = Query(default=None, ge=1, le=500),
        offset: int = Query(default=0, ge=0),
    ) -> Json:
        rows = svc.image_registries.list(who.tenant, name_contains)
        if cursor is not None or page_size is not None:  # cursor paging: the cursor is an offset
            start = _cursor(cursor)
            size = page_size or 20
            page = rows[start : start + size]
            more = start + size < len(rows)
            items = [registry_json(r) for r in page]
            return {"items": items, "registries": items,
                    "next_cursor": str(start + size) if more else None}  # fmt: skip
        page = rows[offset : offset + (limit or 50)]
        items = [registry_json(r) for r in page]
        return {"items": items, "registries": items, "offset": offset, "next_cursor": None}

    @api.get("/registries/{name}")
    async def retrieve(name: str, svc: FrontDep, who: Caller) -> Json:
        return registry_json(_named(svc, who.tenant, name))

    @api.patch("/registries/{name}")
    async def update(name: str, svc: FrontDep, who: Caller, body: JsonBody) -> Json:
        row = _named(svc, who.tenant, name)
        change = _read(RegistryUpdate, body)
        return registry_json(svc.image_registries.update(who.tenant, row.id, change))

    @api.delete("/registries/{name}", status_code=204)
    async def delete(name: str, svc: FrontDep, who: Caller) -> Response:
        svc.image_registries.delete(who.tenant, _named(svc, who.tenant, name).id)
        return Response(status_code=204)

    return api


def registry_json(row: RegistryRecord) -> Json:
    """As the SDK's RegistryResponse: never the password."""
    return {
        "id": row.id,
        "name": row.name,
        "url": row.url,
        "auth_type": "DOCKER_CONFIG",
        "aws_role_arn": None,
        "provider": "DOCKER_REGISTRY",
        "repository_search_mode": "NONE",
        "created_at": iso(row.created_at),
        "updated_at": iso(row.updated_at),
        "created_by": None,
        "updated_by": None,
    }


def _named(svc: Front, tenant: str, name: str) -> RegistryRecord:
    try:
        return svc.image_registries.get(tenant, name)
    except errors.NotFound:
        raise errors.NotFound(f"Registry '{name}' not found") from None


def _read(model: type[M], body: Json) -> M:
    unknown = set(body) - FIELDS
    if unknown:
        raise errors.InvalidArgument(f"unknown fields {sorted(unknown)}")
    if body.get("auth_type") not in (None, "DOCKER_CONFIG") or body.get("aws_role_arn"):
        raise not_supported("registries that authenticate with an AWS role (auth_type AWS_ROLE)")
    fields = {k: v for k, v in body.items() if k in {"name", "url", "username", "password"}}
    try:
        return model.model_validate(fields)
    except ValidationError as exc:
        raise errors.InvalidArgument(describe(exc.errors())) from None


def _cursor(cursor: str | None) -> int:
    if cursor is None:
        return 0
    if not cursor.isdigit() or len(cursor) > 9:
        raise errors.InvalidArgument("cursor is not one this API gave")
    return int(cursor)
