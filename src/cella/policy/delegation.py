"""Access delegation tokens: what lets code in a sandbox call cella's API as the sandbox's
creator. The egress proxy mints one for each request to cella's API host (the guest never
holds one) from the sandbox's own key; the daemon checks it, then the creator's key, on
every request. Pure: the proxy imports it too."""

from __future__ import annotations

import hashlib
import hmac
import re
import time

PREFIX = "cdt_"
LIFETIME_SECONDS = 60  # a token outlives its request by little: a stolen one soon is nothing
API_HOST = "cella.api"  # the name the guest calls cella's API by (plain HTTP, to the proxy)
TOKEN = re.compile(rf"^{PREFIX}([A-Za-z0-9._-]{{1,128}})\.(\d{{1,12}})\.([0-9a-f]{{64}})$")


def mint(sandbox_id: str, key: bytes, now: float | None = None) -> str:
    """A token for the sandbox, good for LIFETIME_SECONDS."""
    expires = int(now if now is not None else time.time()) + LIFETIME_SECONDS
    return f"{PREFIX}{sandbox_id}.{expires}.{_mac(key, sandbox_id, expires)}"


def sandbox_of(token: str) -> str | None:
    """The sandbox a token claims to be from (checked by `valid`), or None if it is not
    a delegation token."""
    found = TOKEN.match(token)
    return found[1] if found else None


def valid(token: str, key: bytes, now: float | None = None) -> bool:
    """Whether the token was minted with the sandbox's key and has not expired."""
    found = TOKEN.match(token)
    if found is None:
        return False
    sandbox_id, expires = found[1], int(found[2])
    if expires < (now if now is not None else time.time()):
        return False
    return hmac.compare_digest(found[3], _mac(key, sandbox_id, expires))


def _mac(key: bytes, sandbox_id: str, expires: int) -> str:
    return hmac.new(key, f"{sandbox_id}.{expires}".encode(), hashlib.sha256).hexdigest()
