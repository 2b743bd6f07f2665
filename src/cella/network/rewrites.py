"""Rewrite rules in the egress proxy (part of the addon: stdlib and `cella.policy` only).
A request to a rewrite's host never leaves the host: the proxy sends it over plain HTTP
to the daemon's `/v1/rewrites/{sandbox}/{host}/...` route with the sandbox's rewrite
token, and the daemon hands it to the other sandbox's port as a service URL does. Before
that, its credential headers are stripped, redacted or kept, as the rule says.

The upstream connection is asked for by a name of this process's own (`ROUTE_HOST`, random
at start), which `server_connect` alone pins to the daemon, for plain connections only: a
guest's connection to the rewrite's host that is not an HTTP request the proxy routed (raw
TCP, TLS it does not open) is decided by the sandbox's rules like any other, and a guest
that names `ROUTE_HOST` itself is refused whatever its rules (`*` included): it never
reaches the daemon."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from cella.policy.rewrites import HOST_HEADER, PREFIX, TOKEN_HEADER

ROUTE_HOST = f"{secrets.token_hex(16)}.rewrite.cella"


@dataclass(frozen=True)
class Rewrite:
    host: str
    sandbox: str  # the other sandbox's id
    port: int
    credentials: str  # strip | redact | keep

    @property
    def reason(self) -> str:
        return f"rewritten to port {self.port} of sandbox {self.sandbox}"


@dataclass(frozen=True)
class Rewrites:
    upstream: tuple[str, int]  # the daemon's API
    token: str  # this sandbox's rewrite token
    rules: tuple[Rewrite, ...]

    def find(self, host: str) -> Rewrite | None:
        name = host.lower().rstrip(".")
        return next((r for r in self.rules if r.host == name), None)


def rewrites_from(msg: dict[str, Any]) -> Rewrites | None:
    given = msg.get("rewrites")
    if not given or not given.get("rules"):
        return None
    host, port = given["upstream"]
    rules = tuple(
        Rewrite(str(r["host"]), str(r["sandbox"]), int(r["port"]), str(r["credentials"]))
        for r in given["rules"]
    )
    return Rewrites((str(host), int(port)), str(given["token"]), rules)


def route(req: Any, sandbox: str, rewrites: Rewrites, rule: Rewrite) -> None:
    """The request as the daemon's route takes it: plain HTTP to `ROUTE_HOST` (pinned to
    the daemon), the sandbox and host in the path, the token and the original Host in
    headers of the proxy's own (whatever the sandbox sent by those names)."""
    original = req.host_header or rule.host
    path = req.path if req.path.startswith("/") else "/" + req.path
    req.headers[TOKEN_HEADER] = rewrites.token
    req.headers[HOST_HEADER] = original
    req.scheme = "http"
    req.host = ROUTE_HOST
    req.port = rewrites.upstream[1]
    req.path = f"{PREFIX}/{sandbox}/{rule.host}{path}"
    host, port = rewrites.upstream
    req.host_header = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
