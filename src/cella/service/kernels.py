"""Which kernel new sandboxes boot, and the move to a better one when it is built.

A host set up in minutes serves on a stock kernel while cella's own compiles in the
background (`images/kernel_builds.py`). This room looks for it every few seconds and, once
it is there, has the driver boot new VMs on it; the warm snapshots are then found anew (they
are keyed by kernel), so the pool refills on the new kernel as it is used. Running sandboxes
and existing snapshots keep the kernel they have.
"""

from __future__ import annotations

import logging
from typing import Any

from cella.images.kernel_builds import upgrade_status
from cella.runtime.contract import Driver
from cella.service.periodic import Periodic
from cella.service.warm import WarmSnapshots

log = logging.getLogger("cella.kernels")
LOOK_EVERY = 5.0  # seconds


class Kernels:
    def __init__(self, driver: Driver, warm: WarmSnapshots) -> None:
        self.driver = driver
        self.warm = warm
        self._loop = Periodic("kernel-switch", self.switch, lambda: LOOK_EVERY, log)

    def status(self) -> dict[str, Any]:
        kernel = self.driver.kernel
        return {
            "version": kernel.version,
            "kind": kernel.kind,
            "sha256": kernel.sha256,
            "upgrade": upgrade_status(self.driver.paths, kernel),
        }

    def start(self) -> None:
        if self.driver.kernel.kind != "tuned":  # only then is a better one coming
            self._loop.start()

    async def switch(self) -> bool:
        """Moves new VMs onto a better kernel if one is there; True once cella's own serves
        (nothing better is coming)."""
        if not await self.driver.refresh_boot():
            return False
        self.warm.forget_all()
        kernel = self.driver.kernel
        log.info("new sandboxes boot kernel %s (%s) from now on", kernel.version, kernel.kind)
        return kernel.kind == "tuned"

    async def close(self) -> None:
        await self._loop.close()
