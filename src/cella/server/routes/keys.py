"""API keys (admin only)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from cella import errors
from cella.models import KeyCreate, KeyCreated, KeyInfo
from cella.server.app import Auth
from cella.server.auth import Principal, new_key

router = APIRouter(prefix="/v1/keys", tags=["keys"])


def _admin(who: Principal) -> None:
    if not who.admin:
        raise errors.Forbidden("only an admin key can manage keys")


@router.post("", status_code=201, response_model=KeyCreated)
async def create_key(body: KeyCreate, request: Request, who: Auth) -> KeyCreated:
    """Creates a key for a tenant. The key is shown once; only its hash is stored."""
    _admin(who)
    key_id, key = new_key(request.app.state.store, body.tenant)
    return KeyCreated(id=key_id, tenant=body.tenant, key=key)


@router.get("", response_model=list[KeyInfo])
async def list_keys(request: Request, who: Auth) -> list[KeyInfo]:
    _admin(who)
    return [
        KeyInfo(id=r["id"], tenant=r["tenant"], created_at=r["created_at"], admin=bool(r["admin"]))
        for r in request.app.state.store.list_keys()
    ]


@router.delete("/{key_id}", status_code=204)
async def revoke_key(key_id: str, request: Request, who: Auth) -> Response:
    _admin(who)
    if not request.app.state.store.revoke_key(key_id):
        raise errors.NotFound(f"no key {key_id!r}")
    return Response(status_code=204)
