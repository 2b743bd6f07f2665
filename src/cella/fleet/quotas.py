"""A tenant's limit of live sandboxes, held across the fleet: what every node runs for the
tenant plus what this gateway is making for it right now; and a sandbox's name, unique
across the fleet as on one node (among its creator's and those the tenant sees:
`cella.policy.access.names_clash`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from cella import errors
from cella.fleet.locator import access_shown
from cella.fleet.membership import Membership
from cella.policy.access import names_clash
from cella.service.keys import Principal

LIVE = {"creating", "running", "paused", "starting", "stopping"}


class Quotas:
    def __init__(self, membership: Membership, max_per_tenant: int) -> None:
        self.membership = membership
        self.max_per_tenant = max_per_tenant
        self._inflight: dict[str, int] = {}  # tenant -> sandboxes being made
        # (tenant, creator, name) of creates under way
        self._naming: set[tuple[str, str, str]] = set()
        self._locks: dict[str, asyncio.Lock] = {}  # per tenant: tenants do not wait on others

    @contextlib.asynccontextmanager
    async def admitted(
        self, who: Principal, count: int, name: str | None = None
    ) -> AsyncIterator[None]:
        """Holds `count` of the tenant's cluster-wide quota while they are being made; a
        `name` must be free across the fleet (and is held meanwhile)."""
        creator = who.principal or None
        naming = (who.tenant, who.principal, name or "")
        async with self._locks.setdefault(who.tenant, asyncio.Lock()):
            live = 0  # sandboxes being made are counted once: as this gateway's, in flight
            for _, answer in await self.membership.each("GET", "/v1/sandboxes", who):
                live += sum(1 for b in answer["sandboxes"] if b["state"] in LIVE - {"creating"})
                if name and any(
                    b.get("name") == name and names_clash(creator, access_shown(who.tenant, b))
                    for b in answer["sandboxes"]
                ):
                    raise errors.AlreadyExists(f"sandbox name {name!r} is in use")
            if name and naming in self._naming:
                raise errors.AlreadyExists(f"a sandbox named {name!r} is being made")
            limit = self.max_per_tenant
            if live + self._inflight.get(who.tenant, 0) + count > limit:
                raise errors.QuotaExceeded(
                    f"tenant {who.tenant} has {live} live sandboxes in the fleet; "
                    f"the limit is {limit}"
                )
            self._inflight[who.tenant] = self._inflight.get(who.tenant, 0) + count
            if name:
                self._naming.add(naming)
        try:
            yield
        finally:
            self._inflight[who.tenant] -= count
            self._naming.discard(naming)
