"""Cold boots: many in a row, none may hang (the tsc_early_khz fix in the kernel command
line); the kernel that boots is the one built from its configuration."""

from __future__ import annotations

import pytest

from cella.images.kernel import Kernel, config_fragment, unmet_options
from cella.runtime.qemu.driver import QemuDriver
from tests.vms import VMFactory, qemu_pids

pytestmark = pytest.mark.vm

BOOTS = 50


@pytest.mark.slow
@pytest.mark.timeout(BOOTS * 30)
async def test_fifty_cold_boots_in_a_row(driver: QemuDriver, vm_factory: VMFactory) -> None:
    before = qemu_pids()
    dirs_before = driver.leftovers()
    times = []
    for _ in range(BOOTS):
        vm = await vm_factory(boot_timeout=30)  # a hang would blow this deadline
        r = await vm.agent.exec(["echo", "up"])
        assert r.stdout == b"up\n"
        assert vm.boot_seconds is not None
        times.append(vm.boot_seconds)
        await driver.destroy(vm)
    assert len(times) == BOOTS
    assert qemu_pids() == before
    assert driver.leftovers() == dirs_before


async def test_the_guest_runs_the_kernel_built_from_its_configuration(
    driver: QemuDriver, vm_factory: VMFactory
) -> None:
    """The booted kernel is the one `microvm.config` describes (its own /proc/config.gz),
    with every driver built in (no module is loaded at boot) and cella's patches in: it
    knows every parameter of its command line (an unknown one would be named in its log)."""
    vm = await vm_factory(boot_timeout=30)
    config = await vm.agent.exec(["zcat", "/proc/config.gz"])
    release = await vm.agent.exec(["uname", "-r"])
    modules = await vm.agent.exec(["cat", "/proc/modules"])
    log = await vm.agent.exec(["dmesg"])
    cmdline = await vm.agent.read_file("/proc/cmdline")
    assert b"Kernel command line:" in log.stdout  # the log is there to be searched
    assert b"Unknown kernel command line parameters" not in log.stdout
    if vm.accel == "tcg":
        assert b"lapic_timer_period=" in cmdline and b"noreplace-smp" in cmdline
    assert config.exit_code == 0, config.stderr
    assert unmet_options(config_fragment().decode(), config.stdout.decode()) == []
    assert release.stdout.decode().strip() == Kernel.load(driver.paths).version
    assert release.stdout.decode().strip().endswith("-cella")
    assert modules.exit_code == 0 and modules.stdout == b""
