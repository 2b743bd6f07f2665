"""A node daemon as the gateway talks to it: its URL and admin key (from its Ray actor), and
calls on behalf of a tenant (`X-Cella-Tenant`, which node daemons honour for admin keys)."""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from typing import Any

import httpx2

from cella import errors
from cella.fleet.tls import trusting
from cella.service.keys import PRINCIPAL_HEADER, READ_ONLY_HEADER, ROLES_HEADER, Principal

TIMEOUT = httpx2.Timeout(30.0, read=600.0)
# a read the gateway gathers from every node (lists, status, metrics): a node that does not
# answer in this long fails it, naming the node, instead of holding it for TIMEOUT's read
GATHER_TIMEOUT = httpx2.Timeout(30.0, read=20.0)


def as_header(who: Principal | None) -> dict[str, str]:
    """Headers that make a node daemon act for `who` (None: the gateway itself, as admin)."""
    if who is None or who.admin:
        return {}
    headers = {"x-cella-tenant": who.tenant}
    if who.read_only:  # the node holds it to reads as the gateway did
        headers[READ_ONLY_HEADER] = "1"
    if who.principal:  # the node decides which sandboxes are the caller's as the rule says
        headers[PRINCIPAL_HEADER] = who.principal
        headers[ROLES_HEADER] = ",".join(sorted(who.roles))
    return headers


def raise_for(response: httpx2.Response, node: str) -> None:
    """A node's error answer raised again as the same cella error."""
    if response.is_success:
        return
    try:
        error = response.json()["error"]
        code, message = str(error["code"]), str(error["message"])
    except (ValueError, KeyError, TypeError):
        raise errors.NodeUnavailable(
            f"node {node} answered {response.status_code}: {response.text[:200]}"
        ) from None
    cls = errors.ALL_ERRORS.get(code, errors.CellaError)
    raise cls(message)


@dataclass(eq=False)
class Node:
    name: str
    node_id: str
    url: str
    key: str
    ca_pem: str = ""  # the daemon's own certificate (its URL is https), else plain HTTP
    healthy: bool = True
    reason: str | None = None
    restarts: int = 0
    stale: bool = False  # it stopped answering: its daemon may be back elsewhere (a new port)
    told_addresses: list[str] = field(default_factory=list)  # the fleet's, as last sent
    client: httpx2.AsyncClient = field(init=False)

    def __post_init__(self) -> None:
        verify = self.ssl or True
        self.client = httpx2.AsyncClient(base_url=self.url, timeout=TIMEOUT, verify=verify)

    @property
    def ssl(self) -> ssl.SSLContext | None:
        """A client context trusting the node's certificate (None: plain HTTP)."""
        return trusting(self.ca_pem) if self.ca_pem else None

    def as_source(self) -> dict[str, str | None]:
        """How another node reaches this one to pull from it (an import's `source_*`)."""
        return {"source_url": self.url, "source_key": self.key, "source_ca": self.ca_pem or None}

    def headers(self, who: Principal | None, langsmith: bool = False) -> dict[str, str]:
        """The node's admin key (as the LangSmith API takes keys, with `langsmith`), acting
        for `who`."""
        if langsmith:
            return {"x-api-key": self.key, **as_header(who)}
        return {"authorization": f"Bearer {self.key}", **as_header(who)}

    async def call(
        self, method: str, path: str, who: Principal | None = None, **kwargs: Any
    ) -> httpx2.Response:
        langsmith = kwargs.pop("langsmith", False)
        headers = {**self.headers(who, langsmith), **kwargs.pop("headers", {})}
        try:
            return await self.client.request(method, path, headers=headers, **kwargs)
        except httpx2.TransportError as exc:
            self.stale = True
            raise errors.NodeUnavailable(f"node {self.name} does not answer: {exc}") from None

    async def json(
        self, method: str, path: str, who: Principal | None = None, **kwargs: Any
    ) -> Any:
        response = await self.call(method, path, who, **kwargs)
        raise_for(response, self.name)
        return response.json() if response.content else None

    async def close(self) -> None:
        await self.client.aclose()
