"""Who may use a sandbox, as its managers set it: visibility and shares (the rule itself is
`cella.policy.access`, asked through `Registry.owned`)."""

from __future__ import annotations

from cella.models import SandboxAccess, SandboxAccessView
from cella.policy.access import Permission, Principal
from cella.service.registry import Registry
from cella.store import SandboxRecord


class Sharing:
    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    def get(self, who: Principal, sandbox_id: str) -> SandboxAccessView:
        """The sandbox's creator, visibility and shares, and what the caller may do."""
        row = self.registry.get(who, sandbox_id)
        return view(row, self.registry.permission(who, row))

    async def set(self, who: Principal, sandbox_id: str, to: SandboxAccess) -> SandboxAccessView:
        """Replaces the sandbox's visibility and shares (a caller who manages it). It holds
        from the next request on; a connection already open (a terminal, a port) runs on
        until it ends. A manager who shares it away from itself is answered with no
        permission: it no longer sees the sandbox."""
        async with self.registry.lock(sandbox_id):
            row = self.registry.get(who, sandbox_id, Permission.manage)
            if to.visibility == "tenant" and row.visibility != "tenant":  # its name: the tenant's
                self.registry.check_name(row.tenant, row.creator, row.name, exclude=row.id)
            self.registry.update(sandbox_id, visibility=to.visibility, shares=dict(to.shares))
            self.registry.events.emit(sandbox_id, "access_changed", to.model_dump())
            row = self.registry.row(sandbox_id)
        return view(row, self.registry.permission(who, row))


def view(row: SandboxRecord, level: Permission | None) -> SandboxAccessView:
    return SandboxAccessView.model_validate(
        {
            "visibility": row.visibility,
            "shares": row.shares,
            "creator": row.creator,
            "creator_key": row.creator_key,
            "permission": level.name if level else None,
        }
    )
