"""The host itself: what it may commit and has committed (for operators and placers)."""

from __future__ import annotations

from fastapi import APIRouter

from cella.models import Capacity
from cella.server.deps import Auth, DaemonDep
from cella.service.keys import require_admin

router = APIRouter(prefix="/v1", tags=["meta"])


@router.get("/capacity", response_model=Capacity)
async def capacity(svc: DaemonDep, who: Auth) -> Capacity:
    """RAM and vCPUs: the host's limits, committed and free (admin keys)."""
    require_admin(who, "read the host's capacity")
    return svc.admission.capacity()
