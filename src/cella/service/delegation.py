"""Access delegation: code in a sandbox calls cella's API as the key that created it.

A grant is kept on the sandbox's row: the mode, the permissions, the creator's key id and a
key of the sandbox's own, which the egress proxy mints short-lived tokens with (one per
request to `cella.api`; `cella.policy.delegation`). `Keys.authenticate` honours a token
while it is fresh, its sandbox lives and the creator's key is valid, checking all three on
every request, so revoking the key ends the sandbox's access at once."""

from __future__ import annotations

import secrets

from cella import errors
from cella.models import AccessDelegation
from cella.service.keys import Principal
from cella.store import SandboxRecord


def grant(asked: AccessDelegation | None, creator: Principal | None) -> dict[str, object] | None:
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


def proxy_access(row: SandboxRecord) -> bytes | None:
    """The key the proxy mints the sandbox's tokens with (None: no delegation)."""
    return bytes.fromhex(row.delegation["key"]) if row.delegation else None
