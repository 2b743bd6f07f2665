"""The daemon's real app (every route, middleware and error handler) in this process, its
service on the fake runtime: the SDK talks to it through a transport instead of a socket."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2
from anyio.from_thread import BlockingPortal
from fastapi import FastAPI

from cella import AsyncClient, Client
from cella.config import DaemonSettings
from cella.server.app import create_app
from cella.server.compat import ADAPTERS
from cella.service.daemon import Daemon
from cella.store import Store
from tests.unit.fake_runtime import FakeDriver, FakeVM

URL = "http://cella.test"  # never dialled: the transport carries every request


@dataclass
class InProcess:
    app: FastAPI
    daemon: Daemon
    admin_key: str

    def client(self, key: str | None = None, **kwargs: Any) -> AsyncClient:
        """An async SDK client of the app (the admin's unless `key` is given)."""
        transport = httpx2.ASGITransport(app=self.app)
        return AsyncClient(URL, key or self.admin_key, transport=transport, **kwargs)

    def sync_client(self, portal: BlockingPortal, key: str | None = None) -> Client:
        """A sync SDK client of the app, which runs on `portal`'s event loop."""
        transport = PortalTransport(httpx2.ASGITransport(app=self.app), portal)
        return Client(URL, key or self.admin_key, transport=transport)

    def vm(self, sandbox_id: str) -> FakeVM:
        found = self.daemon.registry.vm(sandbox_id)
        assert isinstance(found, FakeVM)
        return found


@asynccontextmanager
async def serving(root: Path, **settings: Any) -> AsyncIterator[InProcess]:
    """The app with a daemon of its own data directory `root` (no pool: creates boot)."""
    config = DaemonSettings(
        data_dir=root, image_dir=root / "images", **{"pool_size": 0, **settings}
    )
    daemon = Daemon(config, Store(root / "cella.db"), FakeDriver(root))
    admin_key = daemon.keys.ensure_admin_key(root).read_text().strip()
    app = create_app(config, ADAPTERS)  # the foreign APIs too, as `cella serve` has them
    app.state.daemon = daemon  # what the app's lifespan does with a real runtime
    try:
        yield InProcess(app, daemon, admin_key)
    finally:
        await daemon.registry.detach_all()
        daemon.store.close()


class PortalTransport(httpx2.BaseTransport):
    """A sync transport onto an async one that runs on a portal's event loop (the loop
    the app and its daemon live on): the sync SDK against the app in this process."""

    def __init__(self, inner: httpx2.AsyncBaseTransport, portal: BlockingPortal) -> None:
        self.inner = inner
        self.portal = portal

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        # the body read here, so the async side gets a body it can read
        copy = httpx2.Request(
            request.method, request.url, headers=request.headers, content=request.read()
        )

        async def send() -> httpx2.Response:
            response = await self.inner.handle_async_request(copy)
            content = await response.aread()
            return httpx2.Response(response.status_code, headers=response.headers, content=content)

        return self.portal.call(send)
