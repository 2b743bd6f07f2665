"""A LangSmith data-plane request finds its sandbox running: a stopped or paused one is
resumed first, as the SDK expects (not with a read-only key: waking is a write), and one
still starting is waited for (`Lifecycle.awake`)."""

from __future__ import annotations

from cella.service.daemon import Daemon
from cella.service.keys import Principal
from cella.store import SandboxRecord


async def awake(svc: Daemon, who: Principal, sandbox_id: str) -> SandboxRecord:
    """The sandbox, running (see `Lifecycle.awake`)."""
    return await svc.lifecycle.awake(who, sandbox_id)
