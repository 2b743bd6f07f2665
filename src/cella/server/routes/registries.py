"""Image registries: a tenant's credentials for pulling private images (write-only
passwords), named by `registry_id` when a snapshot is built from an image. A fleet gateway
serves them too (it keeps them for the whole fleet)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Response

from cella.models import Registry, RegistryCreate, RegistryList, RegistryUpdate
from cella.server.deps import Auth, FrontDep

router = APIRouter(tags=["registries"])


@router.post("/v1/registries", status_code=201, response_model=Registry)
async def create_registry(body: RegistryCreate, svc: FrontDep, who: Auth) -> Registry:
    """Keeps a registry's credentials (the password is never returned)."""
    return Registry.model_validate(svc.image_registries.create(who.tenant, body))


@router.get("/v1/registries", response_model=RegistryList)
async def list_registries(
    svc: FrontDep,
    who: Auth,
    name_contains: Annotated[str | None, Query(max_length=128)] = None,
) -> RegistryList:
    rows = svc.image_registries.list(who.tenant, name_contains)
    return RegistryList(registries=[Registry.model_validate(r) for r in rows])


@router.get("/v1/registries/{key}", response_model=Registry)
async def get_registry(key: str, svc: FrontDep, who: Auth) -> Registry:
    """A registry by id or name."""
    return Registry.model_validate(svc.image_registries.get(who.tenant, key))


@router.patch("/v1/registries/{key}", response_model=Registry)
async def update_registry(key: str, body: RegistryUpdate, svc: FrontDep, who: Auth) -> Registry:
    return Registry.model_validate(svc.image_registries.update(who.tenant, key, body))


@router.delete("/v1/registries/{key}", status_code=204)
async def delete_registry(key: str, svc: FrontDep, who: Auth) -> Response:
    svc.image_registries.delete(who.tenant, key)
    return Response(status_code=204)
