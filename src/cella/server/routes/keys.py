"""API keys (admin only)."""

from __future__ import annotations

from fastapi import APIRouter, Response

from cella.models import KeyCreate, KeyCreated, KeyInfo
from cella.server.deps import Auth, Service
from cella.service.keys import require_admin

router = APIRouter(prefix="/v1/keys", tags=["keys"])


@router.post("", status_code=201, response_model=KeyCreated)
async def create_key(body: KeyCreate, svc: Service, who: Auth) -> KeyCreated:
    """Creates a key for a tenant. The key is shown once; only its hash is stored."""
    require_admin(who)
    key_id, key = svc.keys.create(body.tenant)
    return KeyCreated(id=key_id, tenant=body.tenant, key=key)


@router.get("", response_model=list[KeyInfo])
async def list_keys(svc: Service, who: Auth) -> list[KeyInfo]:
    return [KeyInfo.model_validate(r) for r in svc.keys.list(who)]


@router.delete("/{key_id}", status_code=204)
async def revoke_key(key_id: str, svc: Service, who: Auth) -> Response:
    svc.keys.revoke(who, key_id)
    return Response(status_code=204)
