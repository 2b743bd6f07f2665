"""What the E2B SDK reads: its sandbox shapes, its error body, its API key header."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from fastapi import Request, Response
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from cella import errors
from cella.models import SandboxState
from cella.server.error_shapes import ErrorShape
from cella.store import SandboxRecord
from cella.store.records import epoch

ENVD_VERSION = "0.5.7"  # what the SDK gates features on (octet-stream uploads, close_stdin)
CLIENT_ID = "cella"
BASE = "base"  # E2B's default template: cella's `default`
FOREVER = timedelta(days=3650)
# E2B's control-plane paths; under /v2/sandboxes only the bare collection and `<id>/connect`
# (the rest of that prefix is LangSmith's)
_PATHS = re.compile(
    r"^/(sandboxes|snapshots|templates|volumes|volumecontent|secrets|default-templates|events)(/.*)?$"
    r"|^/v[23]/templates(/.*)?$"
    r"|^/v2/sandboxes/?$"
    r"|^/v2/sandboxes/(?!boxes/|snapshots|dataplane/)[^/]+/(connect|logs)$"
)
S = SandboxState


SECRET_REFERENCE = re.compile(r"\$\{e2b\.secrets\.([A-Za-z0-9_-]{1,128})\}")


IDENTITY_REFERENCE = re.compile(r"\$\{e2b\.identity\.tokens\.([^{}\x00-\x1f\x7f-\x9f]+)\}")


def as_cella_refs(value: str) -> str:
    """A header value's `${e2b.secrets.NAME}` as cella's `{secret:name}` (E2B's secret
    names are lower-cased) and `${e2b.identity.tokens.NAME}` as `{identity:NAME}`."""
    value = SECRET_REFERENCE.sub(lambda m: "{secret:" + m.group(1).lower() + "}", value)
    return IDENTITY_REFERENCE.sub(lambda m: "{identity:" + m.group(1) + "}", value)


def owns(path: str) -> bool:
    return bool(_PATHS.match(path))


def error_response(exc: errors.CellaError) -> tuple[int, dict[str, Any]]:
    """E2B's `{code, message}` (the SDK reads both before it looks at the status)."""
    status = exc.status if exc.status < 500 or exc.status in (502, 503, 504) else 500
    return status, {"code": status, "message": exc.message}


def render_error(_: Request, exc: errors.CellaError) -> Response:
    status, body = error_response(exc)
    return JSONResponse(body, status_code=status)


def render_http_error(exc: StarletteHTTPException) -> Response:
    body = {"code": exc.status_code, "message": str(exc.detail)}
    return JSONResponse(body, status_code=exc.status_code)


# the control plane's errors, the framework's own (no such route, method) included
ERROR_SHAPE = ErrorShape(lambda request: owns(request.url.path), render_error, render_http_error)


def template_id(row: SandboxRecord) -> str:
    return {"default": BASE, "code-interpreter": "code-interpreter-v1"}.get(
        row.template, row.template
    )


def iso(stamp: datetime) -> str:
    return stamp.isoformat().replace("+00:00", "Z")


@dataclass(frozen=True, slots=True)
class Access:
    """How a sandbox is reached: its envd token, its ports' traffic token (needed by
    ports that are not public, and by the code interpreter's `/contexts`) and the domain
    of `get_host(port)`'s names."""

    token: str
    traffic: str | None
    domain: str


def sandbox_json(row: SandboxRecord, access: Access) -> dict[str, Any]:
    """E2B's `Sandbox`: what create, connect and fork answer."""
    return {
        "templateID": template_id(row),
        "sandboxID": row.id,
        "clientID": CLIENT_ID,
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": access.token,
        "trafficAccessToken": access.traffic,
        "alias": row.template,
        "domain": access.domain,
    }


def state_of(row: SandboxRecord) -> str:
    """E2B knows two states; a stopped sandbox (disk kept, memory not) is its paused."""
    return "running" if row.state in (S.running, S.creating, S.starting) else "paused"


def detail_json(row: SandboxRecord, access: Access | None, disk_mib: int) -> dict[str, Any]:
    """E2B's `SandboxDetail` (get) and, without access, `ListedSandbox` (list)."""
    started = datetime.fromtimestamp(epoch(row.created_at), UTC)
    end = row.ends_at(time.time())  # later by each pause, for a `running` lifetime clock
    ends = datetime.fromtimestamp(end, UTC) if end is not None else started + FOREVER
    allow = row.network.allow
    return {
        "templateID": template_id(row),
        "alias": row.template,
        "sandboxID": row.id,
        "clientID": CLIENT_ID,
        "startedAt": iso(started),
        "endAt": iso(ends),
        "envdVersion": ENVD_VERSION,
        **({"envdAccessToken": access.token, "domain": access.domain} if access else {}),
        "network": network_json(row),
        "cpuCount": row.vcpus,
        "memoryMB": row.memory_mib,
        "diskSizeMB": row.disk_mib or disk_mib,
        "metadata": dict(row.labels),
        "state": state_of(row),
        "allowInternetAccess": "*" in allow,
        "lifecycle": {
            "autoResume": row.auto_resume,
            "onTimeout": "pause" if row.ttl_action in ("pause", "stop") else "kill",
        },
    }


def network_json(row: SandboxRecord) -> dict[str, Any]:
    """What E2B's sandbox info says of its network (never the egress proxy's password)."""
    net = row.network
    out: dict[str, Any] = {"allowPublicTraffic": net.public_ports}
    if net.port_host is not None:
        out["maskRequestHost"] = net.port_host
    if net.upstream_proxy is not None and net.upstream_proxy.scheme == "socks5":
        proxy = {"address": net.upstream_proxy.url.partition("://")[2]}
        if net.upstream_proxy.username is not None:
            proxy["username"] = net.upstream_proxy.username
        out["egressProxy"] = proxy
    return out
