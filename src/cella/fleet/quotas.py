"""A tenant's limit of live sandboxes, held across the fleet, and a sandbox's name, unique
across the fleet as on one node (among its creator's and those the tenant sees:
`cella.policy.access.names_clash`).

Both are read from the gateway's own placement records, so a create asks no node: what the
gateways placed and the states they last saw (a resume they relayed is recorded), plus what
the gateways are making for the tenant right now (`holds.py`: held from admission until its
node has made it and it is recorded, where every gateway sees it; admissions of one tenant
one at a time across the gateways). A lost node's sandboxes do not count (nor clash); one recovered
from its replica counts again, from the node it lives on now. A stopped sandbox that wakes
by itself on traffic (`auto_resume`) counts as live. Records can only say too much (a node
stopped or deleted a sandbox on its own: its idle timeout, its TTL): before a create is
refused, or a name found taken, the nodes holding what was counted are asked for the
tenant's sandboxes (only those nodes, only then) and the records brought up to date.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterable

from cella import errors
from cella.fleet.holds import Holds
from cella.fleet.locator import access_shown
from cella.fleet.membership import Membership
from cella.fleet.placement_table import Placements, Standing
from cella.policy.access import names_clash
from cella.service.keys import Principal

log = logging.getLogger("cella.fleet")
LIVE = {"creating", "running", "paused", "starting", "stopping"}
ASK_TIMEOUT_S = 10.0  # a node asked to confirm what was counted; one that hangs is not waited on


def counts(sandbox: Standing) -> bool:
    """Whether the sandbox counts against its tenant's limit."""
    return sandbox.state in LIVE or (sandbox.state == "stopped" and sandbox.auto_resume)


class Hold:
    """Sandboxes of a tenant admitted and not yet recorded where they were made."""

    def __init__(self, holds: Holds, hold_id: str, count: int) -> None:
        self._holds, self.id, self.left = holds, hold_id, count

    def placed(self, count: int) -> None:
        """`count` of them are recorded now: counted from the records, no longer here."""
        count = min(count, self.left)
        if count:
            self.left -= count
            self._holds.placed(self.id, count)

    def release(self) -> None:
        self._holds.drop(self.id)


class Quotas:
    def __init__(
        self,
        placements: Placements,
        membership: Membership,
        max_per_tenant: int,
        holds: Holds | None = None,
    ) -> None:
        self.placements = placements
        self.membership = membership  # asked only to confirm a refusal
        self.max_per_tenant = max_per_tenant
        self.holds = holds or Holds(placements.db)  # what the gateways are making
        self._locks: dict[str, asyncio.Lock] = {}  # per tenant: tenants do not wait on others

    def live(self, tenant: str) -> int:
        """The tenant's live sandboxes in the fleet, as recorded."""
        return sum(1 for s in self.placements.standing(tenant) if counts(s))

    @contextlib.asynccontextmanager
    async def admitted(
        self, who: Principal, count: int, name: str | None = None
    ) -> AsyncIterator[Hold]:
        """Holds `count` of the tenant's cluster-wide quota while they are being made (the
        hold shrinks as they are recorded: `Hold.placed`); a `name` must be free across
        the fleet (and is held meanwhile)."""
        tenant, limit = who.tenant, self.max_per_tenant
        async with self._locks.setdefault(tenant, asyncio.Lock()):  # this gateway's, first
            if name:
                await self._name_free(who, name)
            hold = None
            for confirmed in (False, True):
                with self.holds.locked(tenant):  # then every gateway's
                    if name and self.holds.naming(tenant, who.principal, name):
                        raise errors.AlreadyExists(f"a sandbox named {name!r} is being made")
                    live, making = self.live(tenant), self.holds.making(tenant)
                    if live + making + count <= limit:
                        made = self.holds.take(tenant, count, who.principal, name or "")
                        hold = Hold(self.holds, made, count)
                        break
                if not confirmed:  # the records may say too much: asked, then counted again
                    counted = [s for s in self.placements.standing(tenant) if counts(s)]
                    await self._confirm(tenant, counted)
            if hold is None:
                raise errors.QuotaExceeded(
                    f"tenant {tenant} has {live} live sandboxes in the fleet"
                    + (f" and {making} being made" if making else "")
                    + f"; the limit is {limit}"
                )
        try:
            yield hold
        finally:
            hold.release()

    async def _name_free(self, who: Principal, name: str) -> None:
        creator = who.principal or None

        def clashing() -> list[str]:
            return [
                p.sandbox_id
                for p in self.placements.named(who.tenant, name)
                if names_clash(creator, access_shown(who.tenant, p.body))
            ]

        if clashing():  # maybe deleted on its node meanwhile: asked
            await self._confirm(who.tenant, [s for s in self.placements.standing(who.tenant)
                                             if s.sandbox_id in clashing()])  # fmt: skip
            if clashing():
                raise errors.AlreadyExists(f"sandbox name {name!r} is in use")

    async def _confirm(self, tenant: str, recorded: Iterable[Standing]) -> None:
        """The records of `recorded` brought up to date from their nodes (each node holding
        any asked once, for the tenant's list); a node that is down or does not answer
        leaves its records as they are."""
        by_node: dict[str, set[str]] = {}
        for sandbox in recorded:
            by_node.setdefault(sandbox.node, set()).add(sandbox.sandbox_id)
        who = Principal.service(tenant)

        async def ask(name: str, ids: set[str]) -> None:
            node = self.membership.up(name)
            if node is None:
                return
            try:
                answer = await asyncio.wait_for(
                    node.json("GET", "/v1/sandboxes", who), ASK_TIMEOUT_S
                )
            except (errors.CellaError, TimeoutError) as exc:
                log.warning("node %s did not confirm %s's sandboxes: %s", name, tenant, exc)
                return
            # only what was recorded there: another copy it holds is not the one routed to
            listed = [b for b in answer["sandboxes"] if b["id"] in ids]
            if listed:
                self.placements.put_many(name, listed)
            for gone in ids - {b["id"] for b in listed}:  # deleted there on its own
                self.placements.deleted(gone)

        await asyncio.gather(*(ask(name, ids) for name, ids in by_node.items()))
