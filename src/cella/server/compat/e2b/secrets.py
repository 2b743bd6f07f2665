"""E2B's secrets API (`/secrets`) on cella's sealed secrets.

An E2B secret is a name and a value the platform keeps; sandboxes name it in their network
rules' header transforms (`${e2b.secrets.NAME}`), and the egress proxy puts the value in as
the request leaves, so the sandbox never holds it. That is a cella secret bound to no host
(used only where a header rule names it). Names are lower-cased, as E2B stores them; the
identifier is `sec_` and the name, so either selects it. No answer carries the value.
"""

from __future__ import annotations

import base64
import re
from datetime import datetime
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from cella import errors
from cella.models import SecretPut
from cella.server.compat.e2b.control import JsonBody, int_param, page_start
from cella.server.compat.e2b.shapes import iso
from cella.server.deps import Caller, DaemonDep
from cella.server.error_shapes import describe
from cella.store import SecretRecord

ID_PREFIX = "sec_"
NAME = re.compile(r"^[a-z0-9_-]{1,128}$")

router = APIRouter(include_in_schema=False)


def secret_json(row: SecretRecord) -> dict[str, Any]:
    return {
        "secretID": ID_PREFIX + row.name,
        "name": row.name,
        "currentVersion": row.version,
        "metadata": row.metadata,
        "createdAt": iso(datetime.fromisoformat(row.created_at)),
        "updatedAt": iso(datetime.fromisoformat(row.updated_at)),
    }


def secret_name(ref: str) -> str:
    """The secret a name or an identifier (`sec_NAME`) selects."""
    name = ref.removeprefix(ID_PREFIX).lower()
    if not NAME.match(name):
        raise errors.InvalidArgument(f"{ref!r} is not a secret name or identifier")
    return name


def secret_put(body: dict[str, Any]) -> SecretPut:
    try:
        return SecretPut.model_validate(
            {"value": body.get("value"), "metadata": body.get("metadata") or {}}
        )
    except ValidationError as exc:
        raise errors.InvalidArgument(describe(exc.errors())) from None


def new_name(raw: Any) -> str:
    """A new secret's name, as E2B stores it (lower-cased)."""
    if not isinstance(raw, str) or raw.startswith(ID_PREFIX) or not NAME.match(raw.lower()):
        raise errors.InvalidArgument(
            "name must be 1-128 letters, digits, '_' or '-' (the sec_ prefix is reserved)"
        )
    return raw.lower()


def next_version(old: SecretRecord, body: dict[str, Any]) -> SecretPut:
    """A new version of the value (and the metadata, when given); the rest as it was."""
    put = secret_put({"metadata": old.metadata, **body})
    return put.model_copy(
        update={"hosts": old.hosts, "auth": old.auth, "inject": old.inject}
        | ({"username": old.username} if old.username else {})
    )


def page(rows: list[SecretRecord], token: str | None, limit: str | None) -> Response:
    start = page_start(token)
    size = int_param(limit, 100, "limit")
    headers = {}
    if start + size < len(rows):
        headers["X-Next-Token"] = base64.urlsafe_b64encode(str(start + size).encode()).decode()
    return JSONResponse([secret_json(r) for r in rows[start : start + size]], headers=headers)


@router.get("/secrets")
async def list_secrets(request: Request, svc: DaemonDep, who: Caller) -> Response:
    q = request.query_params
    return page(svc.egress.list_secrets(who.tenant), q.get("nextToken"), q.get("limit"))


@router.post("/secrets", status_code=201)
async def create_secret(body: JsonBody, svc: DaemonDep, who: Caller) -> dict[str, Any]:
    name = new_name(body.get("name"))
    put = secret_put(body)
    if any(r.name == name for r in svc.egress.list_secrets(who.tenant)):
        raise errors.AlreadyExists(f"secret {name!r} exists")
    return secret_json(await svc.egress.put_secret_applied(who.tenant, name, put))


@router.get("/secrets/{ref}")
async def get_secret(ref: str, svc: DaemonDep, who: Caller) -> dict[str, Any]:
    return secret_json(svc.egress.get_secret(who.tenant, secret_name(ref)))


@router.post("/secrets/{ref}")
async def update_secret(ref: str, body: JsonBody, svc: DaemonDep, who: Caller) -> dict[str, Any]:
    """A new version of the value (and the metadata, when given)."""
    name = secret_name(ref)
    put = next_version(svc.egress.get_secret(who.tenant, name), body)
    return secret_json(await svc.egress.put_secret_applied(who.tenant, name, put))


@router.delete("/secrets/{ref}", status_code=204)
async def delete_secret(ref: str, svc: DaemonDep, who: Caller) -> Response:
    svc.egress.delete_secret(who.tenant, secret_name(ref))
    return Response(status_code=204)
