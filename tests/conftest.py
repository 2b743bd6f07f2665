"""Shared fixtures: one data directory for the run; real microVMs booted from the templates
that `cella setup` built; factories of VMs, daemons and sandboxes that remove what they made.
A VM shared by a module is used only by tests that leave it as they found it; anything
destructive boots its own."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
from hypothesis import HealthCheck, settings

from cella.paths import Paths
from cella.runtime.qemu.driver import QemuDriver
from cella.runtime.qemu.vm import QemuVM
from tests.daemon import DaemonFactory, SandboxFactory
from tests.vms import VMFactory

# the machines running the suite are shared: generating examples may be slow, which says
# nothing about the code under test (deadlines off for the same reason)
settings.register_profile("shared", suppress_health_check=[HealthCheck.too_slow], deadline=None)
settings.load_profile("shared")


@pytest.fixture(scope="session")
def paths() -> Paths:
    return Paths.default()


@pytest.fixture(scope="session")
async def driver(paths: Paths) -> QemuDriver:
    d = QemuDriver(paths)
    await d.prepare()
    return d


@pytest.fixture
async def vm_factory(driver: QemuDriver) -> AsyncIterator[VMFactory]:
    """Boots VMs for one test; each is destroyed when it ends."""
    async with VMFactory(driver) as boot:
        yield boot


@pytest.fixture(scope="module")
async def vm(driver: QemuDriver) -> AsyncIterator[QemuVM]:
    """One VM for a module's tests that leave it as they found it."""
    async with VMFactory(driver) as boot:
        yield await boot(vcpus=2, memory_mib=512)


@pytest.fixture
def daemon_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonFactory]:
    """Starts daemons for one test; each is stopped, and its VMs killed, when it ends."""
    with DaemonFactory(tmp_path_factory) as daemons:
        yield daemons


@pytest.fixture(scope="module")
def module_daemon_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonFactory]:
    """Starts daemons a module's tests share; stopped, their VMs killed, after the last."""
    with DaemonFactory(tmp_path_factory) as daemons:
        yield daemons


@pytest.fixture
def sandbox_factory() -> Iterator[SandboxFactory]:
    """Creates sandboxes for one test (`sandbox_factory(client, **options)`); each is
    deleted when it ends."""
    with SandboxFactory() as sandboxes:
        yield sandboxes
