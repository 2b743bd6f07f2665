"""API keys (admin only)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Response

from cella.models import KeyCreate, KeyCreated, KeyInfo, KeyUseInfo
from cella.server.deps import Auth, FrontDep
from cella.service.keys import require_admin

router = APIRouter(prefix="/v1/keys", tags=["keys"])


@router.post("", status_code=201, response_model=KeyCreated)
async def create_key(body: KeyCreate, svc: FrontDep, who: Auth) -> KeyCreated:
    """Creates a key for a tenant, held by a principal with roles (which of the tenant's
    sandboxes it may use). The key is shown once; only its hash is stored."""
    require_admin(who)
    key_id, key = svc.keys.create(
        body.tenant,
        read_only=body.read_only,
        principal=body.principal,
        roles=body.roles,
        form=body.format,
    )
    made = svc.keys.by_id(key_id)
    assert made is not None
    return KeyCreated(
        id=key_id,
        tenant=body.tenant,
        key=key,
        read_only=made.read_only,
        principal=made.principal,
        roles=sorted(made.roles),
    )


@router.get("/uses", response_model=list[KeyUseInfo])
async def key_uses(
    svc: FrontDep,
    who: Auth,
    key_id: str | None = None,
    tenant: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 100,
) -> list[KeyUseInfo]:
    """The audit log of key use, newest first (admin): every request a valid key made."""
    require_admin(who, "read the audit log")
    return [KeyUseInfo.model_validate(u) for u in svc.keys.uses(key_id, tenant, limit)]


@router.get("", response_model=list[KeyInfo])
async def list_keys(svc: FrontDep, who: Auth) -> list[KeyInfo]:
    return [KeyInfo.model_validate(r) for r in svc.keys.list(who)]


@router.delete("/{key_id}", status_code=204)
async def revoke_key(key_id: str, svc: FrontDep, who: Auth) -> Response:
    svc.keys.revoke(who, key_id)
    return Response(status_code=204)
