"""Access delegation in the egress proxy (part of the addon: stdlib and `cella.policy`
only). A sandbox with a grant reaches cella's API by the name `cella.api`, over plain HTTP
to the proxy: each request gets a token minted for it, in place of whatever credentials the
guest sent, and goes to the daemon's own address (in clear, on this host), or to a fleet
gateway's (over TLS when the grant names the gateway's certificate: `pinned`, the only one
the proxy accepts there; `mitm.py` opens that connection). The guest never holds a token, and a
sandbox without a grant finds `cella.api` is a name like any other (decided by its rules)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cella.policy.delegation import API_HOST, mint

REASON = "cella's API, by access delegation"
CREDENTIALS = ("authorization", "x-api-key", "cookie")


@dataclass(frozen=True)
class ApiAccess:
    sandbox: str
    upstream: tuple[str, int]  # the daemon's API
    key: bytes  # the sandbox's own: tokens are minted with it
    pinned: str | None = None  # a gateway's certificate (PEM): reached over TLS, trusting it alone


def access_from(msg: dict[str, Any]) -> ApiAccess | None:
    api = msg.get("api")
    if not api:
        return None
    host, port = api["upstream"]
    pinned = api.get("tls")
    return ApiAccess(
        msg["sandbox"], (str(host), int(port)), bytes.fromhex(api["key"]), str(pinned or "") or None
    )


def is_api(api: ApiAccess | None, host: str) -> bool:
    return api is not None and host.lower().rstrip(".") == API_HOST


def authorize(headers: Any, api: ApiAccess) -> None:
    """The request's credentials are the sandbox's fresh token, for either of cella's APIs
    (/v1 reads a bearer key, LangSmith's `X-Api-Key`)."""
    for name in CREDENTIALS:
        headers.pop(name, None)
    token = mint(api.sandbox, api.key)
    headers["authorization"] = f"Bearer {token}"
    headers["x-api-key"] = token
