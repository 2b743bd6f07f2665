"""The REST API under /v1 (FastAPI). Routes are thin: the service does the work."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from cella import errors
from cella.paths import Paths
from cella.server.auth import Principal, authenticate, ensure_admin_key
from cella.server.settings import Settings

log = logging.getLogger("cella.server")


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        from cella.runtime.qemu.driver import QemuDriver
        from cella.service.sandboxes import SandboxService
        from cella.store import Store

        paths = Paths(settings.data_dir, settings.image_dir)
        paths.ensure()
        store = Store(paths.root / "cella.db")
        ensure_admin_key(store, paths.root)
        # VMs outlive the daemon so that a restart (or crash) re-adopts them
        driver = QemuDriver(paths, settings.accel, die_with_parent=False)
        await driver.prepare()
        service = SandboxService(settings, store, driver)
        app.state.store = store
        app.state.service = service
        await service.recover()
        await service.start()
        host, port = settings.host_port
        (paths.root / "daemon.json").write_text(json.dumps({"url": f"http://{host}:{port}"}))
        try:
            yield
        finally:
            await service.shutdown()
            store.close()

    app = FastAPI(
        title="cella",
        version="1",
        description="MicroVM sandboxes for AI coding agents.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    _install_error_handlers(app)

    from cella.server.routes import egress, files, keys, sandboxes, snapshots

    app.include_router(sandboxes.router)
    app.include_router(snapshots.router)
    app.include_router(files.router)
    app.include_router(keys.router)
    app.include_router(egress.router)

    @app.get("/v1/health", tags=["meta"])
    async def health() -> dict[str, Any]:
        """Liveness, and the accelerator this host uses (no key needed)."""
        service = getattr(app.state, "service", None)
        accel = service.driver.accel if service else None
        return {
            "ok": True,
            "accel": accel.accel if accel else None,
            "accel_reason": accel.reason if accel else None,
            "pool": service.pool.status() if service else {},
            "pool_size": service.pool.size if service else 0,
        }

    return app


def principal(request: Request, authorization: Annotated[str | None, Header()] = None) -> Principal:
    return authenticate(request.app.state.store, authorization)


Auth = Annotated[Principal, Depends(principal)]


def error_body(code: str, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message}}


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(errors.CellaError)
    async def cella_error(_: Request, exc: errors.CellaError) -> JSONResponse:
        return JSONResponse(error_body(exc.code, exc.message), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = []
        for err in exc.errors()[:10]:
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            problems.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
        return JSONResponse(
            error_body("invalid_argument", "; ".join(problems) or "invalid request"),
            status_code=400,
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed", 401: "unauthenticated"}.get(
            exc.status_code, "http_error"
        )
        return JSONResponse(error_body(code, str(exc.detail)), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return JSONResponse(error_body("internal", f"{type(exc).__name__}"), status_code=500)


def jsonl(obj: Any) -> bytes:
    return (json.dumps(obj, separators=(",", ":")) + "\n").encode()
