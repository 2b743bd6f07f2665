"""Rewrite rules' pure parts, shared by the egress proxy and the daemon: the door between
them (the daemon's path for a rewritten request, the proxy's headers on it) and what a
rule does to a request's credential headers."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

REDACTED = "redacted"
# headers that carry a caller's credentials; Authorization's scheme survives a redaction
CREDENTIAL_HEADERS = ("authorization", "proxy-authorization", "cookie", "x-api-key")
SCHEMED = ("authorization", "proxy-authorization")
SCHEMES = frozenset(
    {"basic", "bearer", "digest", "token", "negotiate", "ntlm", "apikey", "aws4-hmac-sha256"}
)
TOKEN_HEADER = "x-cella-rewrite-token"  # the daemon's proof it is the proxy asking
HOST_HEADER = "x-cella-rewrite-host"  # the Host the sandbox sent, for the other's server
PREFIX = "/v1/rewrites"
FLEET_REWRITE = "x-cella-fleet-rewrite"  # a gateway's delivery: the calling sandbox's id
CARRIED = "x-cella-carried-"  # + a credential header's name: the request's own, delivered


def redact(name: str, value: str) -> str:
    """`redacted`, after the value's auth scheme when it has a known one (only a known
    scheme is kept: a header rule's value may start with its secret)."""
    if name.lower() in SCHEMED:
        scheme, space, rest = value.strip().partition(" ")
        if space and rest and scheme.lower() in SCHEMES:
            return f"{scheme} {REDACTED}"
    return REDACTED


def guard(headers: Any, mode: str, added: Iterable[str] = ()) -> list[str]:
    """Strips (`strip`) or redacts (`redact`) the credential headers and `added` (headers
    the sandbox's rules would set); `keep` leaves them. The names it acted on."""
    if mode == "keep":
        return []
    acted = []
    for name in dict.fromkeys([*CREDENTIAL_HEADERS, *(a.lower() for a in added)]):
        values = headers.get_all(name)
        if not values:
            continue
        acted.append(name)
        if mode == "strip":
            del headers[name]
        else:
            headers.set_all(name, [redact(name, v) for v in values])
    return acted
