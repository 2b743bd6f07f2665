"""Rewrite rules: a host name a sandbox calls, answered by a port of another sandbox of the
same tenant.

When a rule is set, its target (an id or a name) is resolved among the tenant's sandboxes
to an id, or the rule is refused (another tenant's sandbox is not found, as everywhere).
The egress proxy is given the rules with the sandbox's rewrite token; it sends each
request for a rule's host to the daemon (`server/routes/rewrites.py`), where `forward`
checks the token and the sandbox's rules as they are now, and hands the request to the
other sandbox's port as service URLs do (`Ports.http`). A target that is not running is a
503, a port nothing listens on a 502: never a wait.

Who set a sandbox's rules is kept with them (`rewrite_setter`: a create's or `PUT
.../network`'s caller; a fork's inherited rules keep the parent's setter), and every
request re-checks it: the setter's key must still exist (a revoked key is a 403) and may
still exec in the target (a share taken back is a 403). Rules kept before setters were
(`rewrite_setter` NULL) count as set by the sandbox's creator key, or by the tenant when
it has none (a sandbox made before keys had principals, or by an admin acting for it).

A node of a fleet has a `FleetLink` (its gateway's API, the pinned certificate, the key
this node's tokens for the gateway are minted with; the gateway sends it when the node
joins). There the gateway decides: a rule may name a sandbox on another node (the gateway
settled it), and every request goes to the gateway's `/v1/rewrites/...`, which checks the
rule's setter may still use the target and hands it to the target's node (`deliver`).
"""

from __future__ import annotations

import contextlib
import json
import os
import ssl
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2

from cella import errors
from cella.models import NetworkPolicy, RewriteRule, SandboxPort, SandboxState
from cella.policy import access
from cella.policy.access import Permission, Principal
from cella.policy.delegation import mint
from cella.policy.rewrites import HOST_HEADER, PREFIX, TOKEN_HEADER
from cella.service.delegation import PEM
from cella.service.keys import Keys, require_admin
from cella.service.ports import HOP_BY_HOP, HttpResponse, Ports
from cella.service.registry import Registry
from cella.store import SandboxRecord

Request = tuple[str, str, list[tuple[str, str]]]  # method, target, headers
LINK_TIMEOUT = httpx2.Timeout(30.0, read=600.0)


def setter_of(who: Principal, network: NetworkPolicy) -> dict[str, Any] | None:
    """What is kept of who set a policy's rewrite rules (None: it has none)."""
    if not network.rewrites:
        return None
    return {
        "tenant": who.tenant,
        "key_id": who.key_id,
        "name": who.name,
        "roles": sorted(who.roles),
        "read_only": who.read_only,
    }


def kept_setter(row: SandboxRecord) -> dict[str, Any]:
    """Who set a sandbox's rewrite rules as kept; for rules kept before setters were, its
    creator's key (or, with none, the tenant)."""
    if row.rewrite_setter is not None:
        return row.rewrite_setter
    return {"tenant": row.tenant, "key_id": row.creator_key}


@dataclass(frozen=True)
class FleetLink:
    """A fleet gateway's door for this node's rewrites."""

    url: str  # its API: https://host:port (or http:// on one host)
    key: bytes  # this node's: the tokens it sends the gateway are minted with it
    tls: str | None  # the gateway's certificate (PEM), the only one trusted there

    @classmethod
    def of(cls, given: Any) -> FleetLink:
        try:
            url, key, tls = str(given["url"]), bytes.fromhex(given["key"]), given.get("tls")
        except (KeyError, TypeError, ValueError):
            raise errors.InvalidArgument("a fleet link is {url, key (hex), tls}") from None
        if not url.startswith(("http://", "https://")) or len(key) < 32:
            raise errors.InvalidArgument("a fleet link needs an http(s) URL and a 32-byte key")
        if tls is not None and not (isinstance(tls, str) and PEM.match(tls)):
            raise errors.InvalidArgument("a fleet link's tls is one PEM certificate")
        if url.startswith("https://") != (tls is not None):
            raise errors.InvalidArgument("a fleet link's https URL comes with its certificate")
        return cls(url.rstrip("/"), key, tls)

    def to_json(self) -> dict[str, Any]:
        return {"url": self.url, "key": self.key.hex(), "tls": self.tls}

    def context(self) -> ssl.SSLContext | None:
        """Trusts the gateway's certificate alone (as the egress proxy does for
        `cella.api`): whatever issued it, whatever names it holds."""
        if self.tls is None:
            return None
        context = ssl.create_default_context(cadata=self.tls)
        context.check_hostname = False
        context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
        return context


class Rewrites:
    def __init__(
        self,
        registry: Registry,
        ports: Ports,
        keys: Keys,
        *,
        tls: bool,
        link_file: Path | None = None,
    ) -> None:
        self.registry = registry
        self.ports = ports
        self.keys = keys
        self.tls = tls  # the proxy reaches the daemon over plain HTTP only
        self.link_file = link_file
        self.link: FleetLink | None = None
        self._client: httpx2.AsyncClient | None = None
        if link_file is not None and link_file.exists():
            with contextlib.suppress(ValueError, errors.InvalidArgument):
                self.link = FleetLink.of(json.loads(link_file.read_text()))

    async def set_link(self, who: Principal, given: Any) -> None:
        """This node joins a fleet whose gateway decides its rewrites (kept across restarts)."""
        require_admin(who, "link this node to a fleet gateway")
        link = FleetLink.of(given)
        if self.link_file is not None:
            fd = os.open(self.link_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(link.to_json(), f)
        if link != self.link and self._client is not None:
            await self._client.aclose()
            self._client = None
        self.link = link

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
            if self.link is not None:  # on another node: the gateway settled it, and checks
                return rule  # the setter's access on every request
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
        if self.link is not None:
            return await self._via_gateway(self.link, sandbox_id, rule.host, request, body,
                                           shown_host)  # fmt: skip
        target = self.registry.store.get_sandbox(rule.to.sandbox)
        if target is None or target.tenant != row.tenant or target.state == SandboxState.deleted:
            raise errors.SandboxUnavailable(
                f"{host}: sandbox {rule.to.sandbox} no longer exists (rewrite rule)"
            )
        setter = self.setter(row, host)
        try:
            self.registry.get(setter, target.id, Permission.exec)
        except (errors.NotFound, errors.PermissionDenied):
            raise errors.PermissionDenied(
                f"{host}: the rewrite rule's setter may no longer exec in sandbox {target.id}"
            ) from None
        return await self._to_port(row.tenant, target.id, rule.to.port, host, request, body,
                                   shown_host)  # fmt: skip

    def setter(self, row: SandboxRecord, host: str) -> Principal:
        """Who set the sandbox's rules, as their key says now (an admin acting for the
        tenant, or the tenant: as it acted); refused once the key is revoked."""
        saved = kept_setter(row)
        key_id = saved.get("key_id")
        if key_id is None:
            roles = saved.get("roles")
            return Principal(
                row.tenant,
                admin=False,
                read_only=bool(saved.get("read_only")),
                name=str(saved.get("name") or ""),
                roles=access.TENANT_WIDE
                if roles is None
                else frozenset(access.Role(r) for r in roles),
            )
        now = self.keys.by_id(str(key_id))
        if now is None or now.tenant != row.tenant:
            raise errors.PermissionDenied(f"rewrite {host}: the key that set the rule is revoked")
        return now

    async def deliver(
        self,
        who: Principal,
        sandbox_id: str,
        port: int,
        request: Request,
        body: AsyncIterable[bytes],
        shown_host: str,
    ) -> HttpResponse:
        """A rewritten request the fleet's gateway hands to a sandbox here: `who` is the
        rule's setter, who must still be allowed to exec in it."""
        try:
            target = self.registry.get(who, sandbox_id, Permission.exec)
        except (errors.NotFound, errors.PermissionDenied):
            raise errors.PermissionDenied(
                f"{shown_host}: the rewrite rule's setter may no longer exec in sandbox "
                f"{sandbox_id}"
            ) from None
        return await self._to_port(target.tenant, target.id, port, shown_host, request, body,
                                   shown_host)  # fmt: skip

    async def _to_port(
        self,
        tenant: str,
        target: str,
        port: int,
        host: str,
        request: Request,
        body: AsyncIterable[bytes],
        shown_host: str,
    ) -> HttpResponse:
        method, path, headers = request
        try:
            return await self.ports.http(
                Principal.service(tenant), target, port, method, path, headers, body, shown_host
            )
        except errors.InvalidState:  # stopped, stopping, starting, failed
            state = self.registry.row(target).state
            raise errors.SandboxUnavailable(
                f"{host}: sandbox {target} is {state}, not running (rewrite rule)"
            ) from None

    async def _via_gateway(
        self,
        link: FleetLink,
        sandbox_id: str,
        host: str,
        request: Request,
        body: AsyncIterable[bytes],
        shown_host: str,
    ) -> HttpResponse:
        """The request on to the fleet's gateway, as this node's (a token for the sandbox
        minted with the link's key); its answer, whatever it is, streamed back."""
        if self._client is None:
            verify: ssl.SSLContext | bool = link.context() or True
            self._client = httpx2.AsyncClient(timeout=LINK_TIMEOUT, verify=verify)
        method, target, headers = request
        sent = [(k, v) for k, v in headers if k.lower() not in HOP_BY_HOP | {"host"}]
        sent += [(TOKEN_HEADER, mint(sandbox_id, link.key)), (HOST_HEADER, shown_host)]
        url = f"{link.url}{PREFIX}/{sandbox_id}/{host}{target}"
        asked = self._client.build_request(method, url, headers=sent, content=body)
        try:
            answer = await self._client.send(asked, stream=True)
        except httpx2.TransportError as exc:
            raise errors.SandboxUnavailable(
                f"{host}: the fleet's gateway does not answer (rewrite rule): {exc}"
            ) from None

        async def streamed() -> AsyncIterator[bytes]:
            try:
                async for chunk in answer.aiter_raw():
                    yield chunk
            finally:
                await answer.aclose()

        kept = [(k, v) for k, v in answer.headers.multi_items() if k.lower() not in HOP_BY_HOP]
        return HttpResponse(answer.status_code, answer.reason_phrase, kept, streamed())
