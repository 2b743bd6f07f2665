"""Rewrite rules: a host name a sandbox calls, answered by a port of another sandbox of the
same tenant.

When a rule is set, its target (an id or a name) is resolved among the tenant's sandboxes
to an id, or the rule is refused (another tenant's sandbox is not found, as everywhere).
The egress proxy is given the rules with the sandbox's rewrite token; it sends each
request for a rule's host to the daemon (`server/routes/rewrites.py`), where `forward`
checks the token and the sandbox's rules as they are now, and hands the request to the
other sandbox's port as service URLs do (`Ports.http`). A target that is not running is a
503, a port nothing listens on a 502: never a wait.
"""

from __future__ import annotations

from collections.abc import AsyncIterable
from typing import Any

from cella import errors
from cella.models import NetworkPolicy, RewriteRule, SandboxPort, SandboxState
from cella.policy.access import Permission, Principal
from cella.service.ports import HttpResponse, Ports
from cella.service.registry import Registry
from cella.store import SandboxRecord


class Rewrites:
    def __init__(self, registry: Registry, ports: Ports, *, tls: bool) -> None:
        self.registry = registry
        self.ports = ports
        self.tls = tls  # the proxy reaches the daemon over plain HTTP only

    def settle(self, who: Principal, policy: NetworkPolicy) -> NetworkPolicy:
        """The policy with each rewrite's target as the id of a live sandbox of the tenant
        that `who` may exec in; `InvalidArgument` naming the rule otherwise."""
        if not policy.rewrites:
            return policy
        if self.tls:
            raise errors.InvalidArgument(
                "rewrites: not supported by a daemon serving TLS without a proxy_api_port "
                "(the egress proxy reaches the daemon in clear on loopback)"
            )
        rules = [self._settled(who, rule) for rule in policy.rewrites]
        return policy.model_copy(update={"rewrites": rules})

    def _settled(self, who: Principal, rule: RewriteRule) -> RewriteRule:
        given = rule.to.sandbox
        try:
            try:
                target = self.registry.get(who, given, Permission.exec)
            except errors.NotFound:
                target = self.registry.named(who, given, Permission.exec)
        except (errors.NotFound, errors.PermissionDenied):
            raise errors.InvalidArgument(
                f"rewrite {rule.host}: no sandbox {given!r} of this tenant that this key "
                "may exec in"
            ) from None
        to = SandboxPort(sandbox=target.id, port=rule.to.port)
        return rule.model_copy(update={"to": to})

    def for_proxy(self, row: SandboxRecord, upstream: tuple[str, int]) -> dict[str, Any] | None:
        """What the egress proxy is given of a sandbox's rewrites: where the daemon is, the
        sandbox's token, the rules."""
        if not row.network.rewrites:
            return None
        rules = [
            {
                "host": r.host,
                "sandbox": r.to.sandbox,
                "port": r.to.port,
                "credentials": r.credentials,
            }
            for r in row.network.rewrites
        ]
        token = self.ports.rewrite_token(row.id)
        return {"upstream": list(upstream), "token": token, "rules": rules}

    async def forward(
        self,
        sandbox_id: str,
        host: str,
        token: str,
        request: tuple[str, str, list[tuple[str, str]]],
        body: AsyncIterable[bytes],
        shown_host: str,
    ) -> HttpResponse:
        """One request of sandbox `sandbox_id` to `host` (method, target, headers), as the
        proxy sent it, to the port its rule names now; `shown_host` is the Host the
        sandbox sent."""
        self.ports.check_rewrite(sandbox_id, token)
        row = self.registry.row(sandbox_id)
        rule = next((r for r in row.network.rewrites if r.host == host.lower()), None)
        if rule is None:
            raise errors.NotFound(f"sandbox {sandbox_id} has no rewrite for {host}")
        target = self.registry.store.get_sandbox(rule.to.sandbox)
        if target is None or target.tenant != row.tenant or target.state == SandboxState.deleted:
            raise errors.SandboxUnavailable(
                f"{host}: sandbox {rule.to.sandbox} no longer exists (rewrite rule)"
            )
        method, path, headers = request
        try:
            return await self.ports.http(
                Principal.service(row.tenant),
                target.id,
                rule.to.port,
                method,
                path,
                headers,
                body,
                shown_host,
            )
        except errors.InvalidState:  # stopped, stopping, starting, failed
            state = self.registry.row(target.id).state
            raise errors.SandboxUnavailable(
                f"{host}: sandbox {target.id} is {state}, not running (rewrite rule)"
            ) from None
