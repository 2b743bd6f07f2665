"""The REST API under /v1 (FastAPI). Routes are thin: the daemon's service rooms do the work."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from cella import errors
from cella.config import DaemonSettings

log = logging.getLogger("cella.server")


def create_app(settings: DaemonSettings | None = None) -> FastAPI:
    settings = settings or DaemonSettings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        from cella.service.daemon import Daemon

        daemon = Daemon.open(settings)
        app.state.daemon = daemon
        try:
            await daemon.start()
            yield
        finally:
            await daemon.shutdown()

    app = FastAPI(
        title="cella",
        version="1",
        description="MicroVM sandboxes for AI coding agents.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    install_error_handlers(app)

    from cella.server.routes import (
        egress,
        evals,
        files,
        host,
        keys,
        ports,
        sandboxes,
        snapshots,
        templates,
        terminal,
    )

    app.include_router(sandboxes.router)
    app.include_router(ports.router)
    app.include_router(snapshots.router)
    app.include_router(files.router)
    app.include_router(keys.router)
    app.include_router(egress.router)
    app.include_router(templates.router)
    app.include_router(host.router)
    app.include_router(evals.router)
    app.include_router(terminal.router)
    from cella.server.compat import e2b, langsmith

    langsmith.install(app)
    e2b.install(app)
    from cella.server import ui

    ui.install(app)
    from cella.server.hosts import HostRouting

    app.add_middleware(HostRouting, domain=settings.ports_domain, own_ports=e2b.OWN_PORTS)
    from cella.server.audit import AuditKeyUse

    app.add_middleware(AuditKeyUse, keep=settings.audit_keep)
    from cella.server.forwarded import ForwardedProto

    app.add_middleware(ForwardedProto)

    @app.get("/v1/health", tags=["meta"])
    async def health() -> dict[str, Any]:
        """Liveness, and the accelerator this host uses (no key needed)."""
        daemon = getattr(app.state, "daemon", None)
        if daemon is None:
            return {"ok": True, "accel": None, "accel_reason": None, "pool": {}, "pool_size": 0}
        return daemon.health()  # type: ignore[no-any-return]

    return app


def describe(problems: Sequence[Any]) -> str:
    """Validation errors (pydantic's) as one line: `field: what is wrong; ...`."""
    parts = []
    for err in list(problems)[:10]:
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    return "; ".join(parts) or "invalid request"


def error_body(code: str, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message}}


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(errors.CellaError)
    async def cella_error(request: Request, exc: errors.CellaError) -> JSONResponse:
        from cella.server.compat import e2b, langsmith

        if e2b.envd.owns(request):  # each foreign SDK reads its own shape
            return e2b.envd.error_response(request, exc)  # type: ignore[return-value]
        if e2b.owns(request.url.path):
            status, body = e2b.error_response(exc)
            return JSONResponse(body, status_code=status)
        if request.url.path.startswith(langsmith.PREFIXES):  # its SDK reads its own shape
            dataplane = "/dataplane/" in request.url.path
            status, body = langsmith.error_response(exc, dataplane)
            headers = {"retry-after": "0"} if status == 429 else None
            return JSONResponse(body, status_code=status, headers=headers)
        return JSONResponse(error_body(exc.code, exc.message), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return await cella_error(request, errors.InvalidArgument(describe(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        from cella.server.compat import e2b

        if e2b.owns(request.url.path):
            body = {"code": exc.status_code, "message": str(exc.detail)}
            return JSONResponse(body, status_code=exc.status_code)
        code = {404: "not_found", 405: "method_not_allowed", 401: "unauthenticated"}.get(
            exc.status_code, "http_error"
        )
        return JSONResponse(error_body(code, str(exc.detail)), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return JSONResponse(error_body("internal", f"{type(exc).__name__}"), status_code=500)
