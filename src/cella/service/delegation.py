"""Access delegation: code in a sandbox calls cella's API as the key that created it.

A grant is kept on the sandbox's row: the mode, the permissions, the creator's key id and a
key of the sandbox's own, which the egress proxy mints short-lived tokens with (one per
request to `cella.api`; `cella.policy.delegation`). `Keys.authenticate` honours a token
while it is fresh, its sandbox lives and the creator's key is valid, checking all three on
every request, so revoking the key ends the sandbox's access at once.

A sandbox a fleet gateway places gets the gateway's grant instead (`FLEET_GRANT`, from an
admin key acting for the tenant): the creator's key is the gateway's, tokens are checked
there, and the proxy takes `cella.api` to the gateway's address (over TLS with the gateway's
certificate pinned when it serves TLS: `tls`, the certificate's PEM), so the code in the
sandbox sees the whole fleet."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import re
import secrets
from typing import Any

from cella import errors
from cella.config import DaemonSettings
from cella.models import AccessDelegation
from cella.service.keys import Principal
from cella.store import SandboxRecord

Json = dict[str, Any]


def api_address(settings: DaemonSettings) -> tuple[str, int]:
    """Where the daemon's own API is reached in clear from this host (any-address listens:
    loopback; a daemon serving TLS: its clear loopback port for the proxy)."""
    if settings.tls_cert is not None and settings.proxy_api_port:
        return "127.0.0.1", settings.proxy_api_port
    host, port = settings.host_port
    host = host.strip("[]")
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(host).is_unspecified:
            host = "127.0.0.1"
    return host, port


def grant(asked: AccessDelegation | None, creator: Principal | None) -> Json | None:
    """What the sandbox's row keeps of a delegation (None: no access)."""
    if asked is None:
        return None
    if creator is None or creator.key_id is None:
        raise errors.InvalidArgument("access_delegation needs the creator's own API key")
    return {
        "mode": asked.mode,
        "permissions": list(asked.permissions),
        "key_id": creator.key_id,
        "key": secrets.token_hex(32),
    }


FLEET_GRANT = "x-cella-grant"  # a fleet gateway's grant for a sandbox it creates here
_KEY = re.compile(r"^[0-9a-f]{64}$")
PEM = re.compile(
    r"^-----BEGIN CERTIFICATE-----\n[A-Za-z0-9+/=\n]{1,16384}-----END CERTIFICATE-----\n?$"
)
SENT = ("key_id", "key", "upstream", "tls")  # what of a gateway's grant a node is sent


def grant_for(
    asked: AccessDelegation, creator: Principal, upstream: tuple[str, int], tls: str | None = None
) -> Json:
    """A fleet gateway's grant (with where its API is reached and, when it serves TLS, the
    certificate the proxy pins), as the node keeps it."""
    made = grant(asked, creator)
    assert made is not None
    return made | {"upstream": [upstream[0], upstream[1]]} | ({"tls": tls} if tls else {})


def given(asked: AccessDelegation | None, header: str) -> Json:
    """The grant a fleet gateway sent (`FLEET_GRANT`) for a create asking `asked`."""
    if asked is None:
        raise errors.InvalidArgument(f"{FLEET_GRANT} without access_delegation")
    try:
        sent = json.loads(header)
        key_id, key, (host, port) = sent["key_id"], sent["key"], sent["upstream"]
    except (ValueError, KeyError, TypeError):
        raise errors.InvalidArgument(f"{FLEET_GRANT}: not a grant") from None
    ok = isinstance(key_id, str) and isinstance(key, str) and bool(_KEY.match(key))
    if not ok or not isinstance(host, str) or not isinstance(port, int):
        raise errors.InvalidArgument(f"{FLEET_GRANT}: not a grant")
    tls = sent.get("tls")
    if tls is not None and not (isinstance(tls, str) and PEM.match(tls)):
        raise errors.InvalidArgument(f"{FLEET_GRANT}: tls is not one PEM certificate")
    return {"mode": asked.mode, "permissions": list(asked.permissions), "key_id": key_id,
            "key": key, "upstream": [host, port]} | ({"tls": tls} if tls else {})  # fmt: skip


def upstream_of(row: SandboxRecord) -> tuple[str, int] | None:
    """Where the proxy takes the sandbox's `cella.api` when not to this daemon (a gateway's)."""
    found = (row.delegation or {}).get("upstream")
    return (str(found[0]), int(found[1])) if found else None


def pinned_of(row: SandboxRecord) -> str | None:
    """The certificate (PEM) the proxy pins on its TLS connection to a gateway's API (None:
    the API is reached in clear, on this host)."""
    found = (row.delegation or {}).get("tls")
    return str(found) if found else None


def proxy_access(row: SandboxRecord) -> bytes | None:
    """The key the proxy mints the sandbox's tokens with (None: no delegation)."""
    return bytes.fromhex(row.delegation["key"]) if row.delegation else None
