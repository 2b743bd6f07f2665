"""What the routes a node daemon and a fleet gateway both serve (API keys and their audit
log, the web console's sessions, eval runs, image registries, and every caller's
authentication) use of the
process that serves them. `Daemon` and the fleet's `Gateway` both implement it; mypy
checks each where an app is given the one it serves (`serve`, `build_app`)."""

from __future__ import annotations

from typing import Protocol

from starlette.applications import Starlette
from starlette.requests import HTTPConnection
from starlette.types import Scope

from cella.service.evals import Evals
from cella.service.image_registries import ImageRegistries
from cella.service.keys import Keys, Principal
from cella.service.sessions import Sessions
from cella.telemetry.prometheus import Exposition


class Front(Protocol):
    @property
    def keys(self) -> Keys: ...

    @property
    def sessions(self) -> Sessions: ...

    @property
    def evals(self) -> Evals: ...

    @property
    def image_registries(self) -> ImageRegistries:
        """A tenant's registries (a gateway keeps them for the fleet, lending a node one
        for the pull that needs it)."""
        ...

    async def snapshot_id(self, who: Principal, ref: str) -> str:
        """The id of the caller's snapshot `ref` (an id, name or name:tag)."""
        ...

    @property
    def prometheus(self) -> Exposition:
        """What this process counts for /metrics."""
        ...

    async def metrics_text(self) -> str:
        """/metrics in Prometheus' text format (a gateway's with its nodes')."""
        ...


class Served(Front, Protocol):
    """A front with a life of its own: started before its app takes requests, shut down
    after the app's last one."""

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...


def serve(app: Starlette, front: Front) -> None:
    """`front` answers the app's requests from now on."""
    app.state.daemon = front


def front_of_scope(scope: Scope) -> Front | None:
    """The front serving the app of this request, once it has started."""
    app = scope.get("app")
    state = getattr(app, "state", None)
    return getattr(state, "daemon", None)


def front_of(conn: HTTPConnection) -> Front:
    found: Front = conn.app.state.daemon
    return found
