"""Request-scoped helpers shared by the route modules."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import Request

if TYPE_CHECKING:
    from cella.service.sandboxes import SandboxService


def service(request: Request) -> SandboxService:
    svc: SandboxService = request.app.state.service
    return svc
