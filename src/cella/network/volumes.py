"""Volume mounts in the egress proxy (part of the addon: stdlib and `cella.policy` only). A
sandbox with volume mounts reaches them as `volumes.cella`, over plain HTTP (rclone's
WebDAV): the proxy sends each such request to the daemon's `/v1/volume-dav/{sandbox}/...`
with the sandbox's mount token in a header of its own, in place of whatever credentials
the guest sent; the daemon serves only the volumes the sandbox mounts. For a sandbox
without mounts `volumes.cella` is a name like any other (decided by its rules)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cella.policy.volumes import BASE_HEADER, DAV_HOST, PREFIX, TOKEN_HEADER

CREDENTIALS = ("authorization", "x-api-key", "cookie", TOKEN_HEADER, BASE_HEADER)


@dataclass(frozen=True)
class VolumeAccess:
    upstream: tuple[str, int]  # the daemon's API
    token: str  # this sandbox's mount token


def volumes_from(msg: dict[str, Any]) -> VolumeAccess | None:
    given = msg.get("volumes")
    if not given:
        return None
    host, port = given["upstream"]
    return VolumeAccess((str(host), int(port)), str(given["token"]))


def is_volumes(access: VolumeAccess | None, host: str) -> bool:
    return access is not None and host.lower().rstrip(".") == DAV_HOST


def route(req: Any, sandbox: str, access: VolumeAccess, route_host: str) -> None:
    """The request as the daemon's route takes it: plain HTTP to `route_host` (which the
    proxy pins to the daemon), the sandbox in the path, the token in the proxy's header."""
    for name in CREDENTIALS:
        req.headers.pop(name, None)
    req.headers[TOKEN_HEADER] = access.token
    req.headers[BASE_HEADER] = "/"  # the guest asked for /{volume}/...
    path = req.path if req.path.startswith("/") else "/" + req.path
    req.scheme = "http"
    req.host = route_host
    req.port = access.upstream[1]
    req.path = f"{PREFIX}/{sandbox}{path}"
    host, port = access.upstream
    req.host_header = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
