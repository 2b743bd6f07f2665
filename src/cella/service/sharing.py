"""Who may use a sandbox, as its managers set it: visibility and shares (the rule itself is
`cella.policy.access`, asked through `Registry.owned`)."""

from __future__ import annotations

from cella.models import SandboxAccess, SandboxAccessView
from cella.policy import access
from cella.policy.access import Permission, Principal
from cella.service.registry import Registry, access_of
from cella.store import SandboxRecord


class Sharing:
    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    def get(self, who: Principal, sandbox_id: str) -> SandboxAccessView:
        """The sandbox's creator, visibility and shares, and what the caller may do."""
        return view(who, self.registry.get(who, sandbox_id))

    async def set(self, who: Principal, sandbox_id: str, to: SandboxAccess) -> SandboxAccessView:
        """Replaces the sandbox's visibility and shares (a caller who manages it). It holds
        from the next request on; a connection already open (a terminal, a port) runs on
        until it ends."""
        async with self.registry.lock(sandbox_id):
            self.registry.get(who, sandbox_id, Permission.manage)
            self.registry.update(sandbox_id, visibility=to.visibility, shares=dict(to.shares))
            self.registry.events.emit(sandbox_id, "access_changed", to.model_dump())
        return self.get(who, sandbox_id)


def view(who: Principal, row: SandboxRecord) -> SandboxAccessView:
    level = access.permission(who, access_of(row))  # as `Registry.permission`
    assert level is not None  # the row was found for `who`
    return SandboxAccessView.model_validate(
        {
            "visibility": row.visibility,
            "shares": row.shares,
            "creator": row.creator,
            "creator_key": row.creator_key,
            "permission": level.name,
        }
    )
