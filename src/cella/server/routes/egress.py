"""Egress: a sandbox's network policy and decision log, and the tenant's secrets."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Response

from cella.models import (
    EgressBoundary,
    EgressDecision,
    EgressLog,
    KeyRotation,
    NetworkPolicy,
    Sandbox,
    Secret,
    SecretList,
    SecretPut,
)
from cella.models.network import SECRET_NAME, FleetAddresses
from cella.server.deps import Auth, DaemonDep
from cella.service.keys import require_admin

router = APIRouter(tags=["egress"])
SecretName = Annotated[str, Path(pattern=SECRET_NAME, description="secret name")]


@router.put("/v1/sandboxes/{sandbox_id}/network", response_model=Sandbox)
async def set_network(sandbox_id: str, body: NetworkPolicy, svc: DaemonDep, who: Auth) -> Sandbox:
    """Replaces the sandbox's egress rules; a running sandbox's next connection uses them."""
    return Sandbox.model_validate(await svc.egress.set_network(who, sandbox_id, body))


@router.get("/v1/sandboxes/{sandbox_id}/egress", response_model=EgressLog)
async def egress_log(
    sandbox_id: str,
    svc: DaemonDep,
    who: Auth,
    after: Annotated[int, Query(ge=0, le=2**63 - 1, description="only after this id")] = 0,
    limit: Annotated[int, Query(ge=1, le=10000)] = 1000,
) -> EgressLog:
    """Every connection the sandbox tried: host, port, allowed or denied and why, bytes."""
    rows = svc.egress.log(who, sandbox_id, after, limit)
    return EgressLog(decisions=[EgressDecision.model_validate(r) for r in rows])


@router.get("/v1/egress/boundary", response_model=EgressBoundary)
async def egress_boundary(svc: DaemonDep, who: Auth) -> EgressBoundary:
    """What tenants' egress rules can never open by themselves (admin keys)."""
    require_admin(who, "read the egress boundary")
    return EgressBoundary.model_validate(svc.egress.boundary.to_json())


@router.put("/v1/egress/boundary/fleet", response_model=EgressBoundary)
async def set_fleet_addresses(body: FleetAddresses, svc: DaemonDep, who: Auth) -> EgressBoundary:
    """Every fleet node's address, closed to sandboxes like the host's own (admin keys: the
    fleet gateway tells each node when the cluster changes)."""
    require_admin(who, "set the fleet's addresses")
    svc.egress.set_fleet_addresses(frozenset(body.addresses))
    return EgressBoundary.model_validate(svc.egress.boundary.to_json())


@router.get("/v1/secrets", response_model=SecretList)
async def list_secrets(svc: DaemonDep, who: Auth) -> SecretList:
    """The tenant's secrets: names and bindings, never values."""
    rows = svc.egress.list_secrets(who.tenant)
    return SecretList(secrets=[Secret.model_validate(r) for r in rows])


@router.put("/v1/secrets/{name}", response_model=Secret)
async def put_secret(name: SecretName, body: SecretPut, svc: DaemonDep, who: Auth) -> Secret:
    """Creates or replaces a secret (write-only: the value is never returned)."""
    return Secret.model_validate(await svc.egress.put_secret_applied(who.tenant, name, body))


@router.post("/v1/secrets-key/rotate", response_model=KeyRotation)
async def rotate_key(svc: DaemonDep, who: Auth) -> KeyRotation:
    """Seals every secret value under a new key (admin). The old key file is replaced once
    the database holds only values the new one opens."""
    require_admin(who, "rotate the secrets key")
    return KeyRotation(resealed=svc.rotate_secrets_key())


@router.get("/v1/secrets/{name}", response_model=Secret)
async def get_secret(name: SecretName, svc: DaemonDep, who: Auth) -> Secret:
    return Secret.model_validate(svc.egress.get_secret(who.tenant, name))


@router.delete("/v1/secrets/{name}", status_code=204)
async def delete_secret(name: SecretName, svc: DaemonDep, who: Auth) -> Response:
    """Deletes a secret; sandboxes that used it keep a placeholder that is never replaced."""
    svc.egress.delete_secret(who.tenant, name)
    return Response(status_code=204)
