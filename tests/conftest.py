"""Shared fixtures: one data directory for the run; real microVMs booted from the templates
that `cella setup` built. A VM shared by a module is used only by tests that leave it as they
found it; anything destructive boots its own."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import pytest

from cella.paths import Paths
from cella.runtime.qemu.driver import QemuDriver
from cella.runtime.qemu.vm import QemuVM


@pytest.fixture(scope="session")
def paths() -> Paths:
    return Paths.default()


@pytest.fixture(scope="session")
async def driver(paths: Paths) -> QemuDriver:
    d = QemuDriver(paths)
    await d.prepare()
    return d


@pytest.fixture(scope="module")
async def vm(driver: QemuDriver) -> AsyncIterator[QemuVM]:
    machine = await driver.boot(vcpus=2, memory_mib=512)
    yield machine
    await driver.destroy(machine)


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
