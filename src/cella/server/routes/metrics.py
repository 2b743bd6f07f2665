"""/metrics: what a daemon (or a fleet's gateway, with its nodes') counts, in Prometheus' text
format. Admin keys only: it names tenants. Prometheus sends the key as a bearer token
(`authorization.credentials_file` in its scrape config, see docs/prometheus.yml)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from cella.server.deps import Auth
from cella.server.front import front_of
from cella.service.keys import require_admin
from cella.telemetry.prometheus import CONTENT_TYPE

router = APIRouter(tags=["meta"])


@router.get("/metrics", response_class=Response, include_in_schema=False)
async def metrics(request: Request, who: Auth) -> Response:
    require_admin(who, "read the metrics")
    return Response(await front_of(request).metrics_text(), media_type=CONTENT_TYPE)
