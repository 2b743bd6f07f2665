"""Real microVMs booted by the QEMU driver directly (no daemon), and the host's QEMU processes.

`VMFactory` boots VMs for a test or a module and destroys every one at the end, whatever
the test did with them (Firecracker's `microvm_factory` is the model)."""

from __future__ import annotations

import os
from types import TracebackType
from typing import Any

from cella.runtime.qemu.driver import QemuDriver
from cella.runtime.qemu.vm import QemuVM


class VMFactory:
    def __init__(self, driver: QemuDriver) -> None:
        self.driver = driver
        self.booted: list[QemuVM] = []

    async def __call__(self, template: str = "default", **options: Any) -> QemuVM:
        """A booted VM (`options` as `QemuDriver.boot` takes them)."""
        vm = await self.driver.boot(template, **options)
        self.booted.append(vm)
        return vm

    async def __aenter__(self) -> VMFactory:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for vm in reversed(self.booted):  # what the test left: running, or on disk
            if vm.running or (vm.directory is not None and vm.directory.exists()):
                await self.driver.destroy(vm)


def qemu_pids() -> set[int]:
    """Every running QEMU process on the host."""
    pids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if f.read().startswith(b"qemu-system"):
                        pids.add(int(entry))
            except OSError:
                continue
    return pids


def qemu_of(sandbox_id: str) -> int:
    """The pid of a sandbox's QEMU."""
    for pid in qemu_pids():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f"/vms/{sandbox_id}/".encode() in f.read():
                    return pid
        except OSError:
            continue
    raise LookupError(f"no QEMU for {sandbox_id}")
