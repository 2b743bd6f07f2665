"""Volume mount tokens kept fresh: the egress proxy reaches a sandbox's volume mounts with a
token that expires (`Ports.mount_token`, `volume_mount_token_seconds`), so one that leaks
(from a log, a proxy's memory) opens nothing for long. Every sandbox with a VM (running or
paused) and volume mounts has its proxy settings given again, with a new token, a third of
the lifetime before the old one ends; a resumed or adopted VM gets one when it is attached.
A deleted sandbox's token is refused at once, whatever its expiry (`Volumes.mount_of`).
"""

from __future__ import annotations

import contextlib
import logging

from cella import errors
from cella.service.egress import SandboxEgress
from cella.service.periodic import Periodic
from cella.service.registry import Registry

log = logging.getLogger("cella.mount_renewal")


class MountRenewal:
    def __init__(self, registry: Registry, egress: SandboxEgress, token_seconds: float) -> None:
        self.registry = registry
        self.egress = egress
        self.interval = max(token_seconds / 3, 0.5)
        self._loop = Periodic("cella-mount-renewal", self._pass, lambda: self.interval, log)

    def renew(self) -> int:
        """New tokens for every tracked VM of a sandbox with volume mounts; how many."""
        renewed = 0
        for sandbox_id, vm in self.registry.vms().items():
            row = self.registry.store.get_sandbox(sandbox_id)
            if row is None or not row.volume_mounts:
                continue
            with contextlib.suppress(errors.CellaError):  # a VM going away meanwhile
                self.egress.attach(vm, row)
                renewed += 1
        return renewed

    async def _pass(self) -> None:
        self.renew()

    def start(self) -> None:
        self._loop.start()

    async def close(self) -> None:
        await self._loop.close()
