"""Many cold boots in a row: none may hang (the tsc_early_khz fix in the kernel command line)."""

from __future__ import annotations

import pytest

from cella.runtime.qemu.driver import QemuDriver
from tests.conftest import qemu_pids

pytestmark = [pytest.mark.vm, pytest.mark.slow]

BOOTS = 50


@pytest.mark.timeout(BOOTS * 30)
async def test_fifty_cold_boots_in_a_row(driver: QemuDriver) -> None:
    before = qemu_pids()
    dirs_before = driver.leftovers()
    times = []
    for _ in range(BOOTS):
        vm = await driver.boot(boot_timeout=30)  # a hang would blow this deadline
        r = await vm.agent.exec(["echo", "up"])
        assert r.stdout == b"up\n"
        assert vm.boot_seconds is not None
        times.append(vm.boot_seconds)
        await driver.destroy(vm)
    assert len(times) == BOOTS
    assert qemu_pids() == before
    assert driver.leftovers() == dirs_before
