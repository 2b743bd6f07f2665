"""Login-mode service URLs: a guest server reached by whoever holds a key (or a console
session) of the sandbox's tenant, instead of by a service token. Each request relayed to
the guest carries who made it, as LangSmith's sandboxes do: `X-Langsmith-User-Token`, a
short-lived JWT signed with the daemon's signing key (`signing.Signer`; verified against
`/.well-known/jwks.json`, e.g. by `langsmith.sandbox.SandboxTokenVerifier`), and the
unsigned `X-Langsmith-User-Id` beside it. Those headers are always removed from what
callers send, so a guest can trust them."""

from __future__ import annotations

import time

from cella.policy.access import Permission, Principal
from cella.service.registry import Registry
from cella.service.signing import Signer

USER_TOKEN_HEADER = "x-langsmith-user-token"
USER_ID_HEADER = "x-langsmith-user-id"
USER_EMAIL_HEADER = "x-langsmith-user-email"
USER_HEADERS = frozenset({USER_TOKEN_HEADER, USER_ID_HEADER, USER_EMAIL_HEADER})
# a fleet gateway's caller (its key id), sent to a node with the gateway's key acting for the
# tenant: what a node's login-mode relay names as the user
FLEET_USER = "x-cella-user"
TOKEN_SECONDS = 300  # each request gets its own; a guest checks it as the request arrives
ACCESS = ("restricted", "workspace")  # LangSmith's; in cella both mean "of the tenant"


class Logins:
    def __init__(self, registry: Registry, signer: Signer) -> None:
        self.registry = registry
        self.signer = signer

    def user_token(
        self, who: Principal, sandbox_id: str, subject: str, *, audience: str, issuer: str
    ) -> str:
        """The token a request of `subject` (a key id) to the sandbox's server carries:
        `aud` is the host the request was sent to, as `SandboxTokenVerifier` checks it."""
        # a sandbox the caller may use (open its servers), or NotFound / PermissionDenied
        tenant = self.registry.get(who, sandbox_id, Permission.exec).tenant
        now = int(time.time())
        return self.signer.sign(
            {
                "iss": issuer,
                "aud": audience,
                "sub": subject,
                "tenant": tenant,
                "sandbox_id": sandbox_id,
                "iat": now,
                "exp": now + TOKEN_SECONDS,
            }
        )
