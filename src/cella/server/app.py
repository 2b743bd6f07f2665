"""The HTTP apps (FastAPI). `build_app` is what every cella app is, a node daemon's or a fleet
gateway's: its error shapes, its doors (sets of routes), the web console, and the
middleware that sees every request. `create_app` is a node daemon's: cella's REST API
under /v1, whose routes are thin (the daemon's service rooms do the work), and the
foreign APIs it is given beside it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI
from starlette.middleware import Middleware

from cella.config import DaemonSettings
from cella.server import ui
from cella.server.audit import AuditKeyUse
from cella.server.error_shapes import install_error_handlers
from cella.server.forwarded import ForwardedProto
from cella.server.front import Served, serve
from cella.server.hosts import HostRouting
from cella.server.request_ids import RequestIds
from cella.server.request_metrics import RequestMetrics
from cella.server.routes import (
    checkpoints,
    downloads,
    egress,
    evals,
    files,
    host,
    keys,
    metrics,
    moves,
    ports,
    precopy,
    registries,
    rewrites,
    sandboxes,
    snapshots,
    templates,
    terminal,
    volume_dav,
    volumes,
    webhooks,
)
from cella.service.daemon import Daemon

Door = Callable[[FastAPI], None]  # installs a set of routes (and what they need) on an app
API = (
    moves,  # before sandboxes: POST /v1/sandboxes/import is not a sandbox's id
    precopy,  # and POST /v1/sandboxes/precopy
    sandboxes,
    ports,
    snapshots,
    checkpoints,
    files,
    downloads,
    keys,
    egress,
    registries,
    templates,
    host,
    evals,
    terminal,
    rewrites,
    webhooks,
    volumes,
    volume_dav,
)


def routes(router: APIRouter) -> Door:
    return lambda app: app.include_router(router)


def build_app(
    settings: DaemonSettings,
    *,
    title: str,
    description: str,
    open_front: Callable[[], Served],
    doors: Sequence[Door],
    inner: Sequence[Middleware] = (),
) -> FastAPI:
    """An app served by what `open_front` opens when the app starts (and shuts down when it
    stops), with `doors` installed in order (the first route that matches a request takes
    it), then the web console; `inner` middleware sees requests after the audit log."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        front = open_front()
        serve(app, front)
        try:
            await front.start()
            yield
        finally:
            await front.shutdown()

    app = FastAPI(title=title, version="1", description=description, lifespan=lifespan)
    app.state.settings = settings
    install_error_handlers(app)
    app.include_router(metrics.router)
    for door in doors:
        door(app)
    ui.install(app)
    for cls, args, kwargs in inner:
        app.add_middleware(cls, *args, **kwargs)
    app.add_middleware(AuditKeyUse, keep=settings.audit_keep)
    app.add_middleware(RequestMetrics)
    app.add_middleware(RequestIds)
    app.add_middleware(ForwardedProto)  # outermost: behind a proxy that terminates TLS
    return app


def create_app(settings: DaemonSettings | None = None, adapters: Sequence[Door] = ()) -> FastAPI:
    """A node daemon's app. `adapters` install the foreign APIs it serves beside /v1
    (`cella.server.compat.ADAPTERS`, what `cella serve` gives it: LangSmith's and E2B's)."""
    settings = settings or DaemonSettings()
    app = build_app(
        settings,
        title="cella",
        description="MicroVM sandboxes for AI coding agents.",
        open_front=lambda: Daemon.open(settings),
        doors=[*(routes(api.router) for api in API), *adapters],
        inner=[Middleware(HostRouting, domain=settings.ports_domain)],
    )

    @app.get("/v1/health", tags=["meta"])
    async def health() -> dict[str, Any]:
        """Liveness, and the accelerator this host uses (no key needed)."""
        daemon = getattr(app.state, "daemon", None)
        if daemon is None:
            return {"ok": True, "accel": None, "accel_reason": None, "pool": {}, "pool_size": 0}
        return daemon.health()  # type: ignore[no-any-return]

    return app
