"""A LangSmith data-plane request finds its sandbox running: a stopped or paused one is
resumed first, as the SDK expects (not with a read-only key: waking is a write), and one
still starting is waited for."""

from __future__ import annotations

import asyncio

from cella import errors
from cella.models import SandboxState
from cella.service.daemon import Daemon
from cella.service.keys import Principal
from cella.store import SandboxRecord

S = SandboxState


async def awake(svc: Daemon, who: Principal, sandbox_id: str) -> SandboxRecord:
    """The sandbox, running: a stopped or paused one is resumed first. Waking is a write
    (it commits RAM and a quota slot), so a read-only key is refused and it sleeps on."""
    row = svc.registry.get(who.tenant, sandbox_id)
    if row.state in (S.stopped, S.paused, S.stopping):
        if who.read_only:
            raise errors.PermissionDenied(
                f"this key is read-only: sandbox {sandbox_id} is {row.state}, and resuming "
                "it is a write"
            )
        row = await svc.lifecycle.resume(who.tenant, sandbox_id)
    elif row.state in (S.creating, S.starting):
        for _ in range(600):
            await asyncio.sleep(0.1)
            row = svc.registry.get(who.tenant, sandbox_id)
            if row.state not in (S.creating, S.starting):
                break
    return row
