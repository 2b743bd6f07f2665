"""VM lifecycle on real microVMs: clean stop, crashes, kills and what they leave behind."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from pydantic import ValidationError

from cella import errors
from cella.models import SandboxCreate
from cella.paths import Paths
from cella.runtime.qemu.driver import QemuDriver
from tests.vms import VMFactory, qemu_pids

pytestmark = pytest.mark.vm


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie still answers kill(0); it is gone for our purposes
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[1].split()[0] == "Z"


async def test_clean_stop_keeps_disk_writes_and_frees_everything(
    driver: QemuDriver, vm_factory: VMFactory
) -> None:
    vm = await vm_factory()
    pid = vm.pid
    assert pid is not None
    await vm.agent.write_file("/workspace/kept.txt", b"kept")
    await vm.stop()
    assert _gone(pid)
    assert not vm.config.agent_socket.exists() and not vm.config.qmp_socket.exists()
    # the guest synced before powering off: the overlay holds the file
    assert vm.config.disk is not None and vm.config.disk.stat().st_size > 0
    await driver.destroy(vm)
    assert vm.directory is not None and not vm.directory.exists()


async def test_guest_panic_is_a_clear_error_and_leaves_nothing(
    driver: QemuDriver, vm_factory: VMFactory
) -> None:
    vm = await vm_factory()
    pid = vm.pid
    assert pid is not None
    with pytest.raises(errors.SandboxCrashed, match="panicked"):
        await vm.agent.exec("echo c > /proc/sysrq-trigger; sleep 30", timeout=60)
    # the QEMU process ended by itself (panic=-1 with -no-reboot)
    assert await asyncio.wait_for(vm.wait(), 10) == 0 or _gone(pid)
    with pytest.raises(errors.SandboxCrashed):
        await vm.agent.exec(["true"])
    await driver.destroy(vm)
    assert _gone(pid)
    assert vm.directory is not None and not vm.directory.exists()


async def test_killed_qemu_fails_running_exec_promptly(
    driver: QemuDriver, vm_factory: VMFactory
) -> None:
    vm = await vm_factory()
    pid = vm.pid
    assert pid is not None

    async def kill_once_running() -> None:  # the exec is in flight: its sleep is seen
        while (await vm.agent.exec(["pgrep", "-fx", "sleep 60"])).exit_code != 0:
            await asyncio.sleep(0.05)
        os.kill(pid, signal.SIGKILL)

    killer = asyncio.create_task(asyncio.wait_for(kill_once_running(), 60))
    start = time.monotonic()
    with pytest.raises(errors.SandboxCrashed, match="killed by signal 9"):
        await vm.agent.exec(["sleep", "60"])
    await killer
    assert time.monotonic() - start < 30
    await driver.destroy(vm)
    assert _gone(pid)
    assert not vm.config.agent_socket.exists() and not vm.config.qmp_socket.exists()


def test_qemu_dies_with_its_host_process(paths: Paths) -> None:
    """kill -9 of the process that booted a VM leaves no QEMU behind."""
    script = textwrap.dedent(
        """
        import asyncio, sys
        from cella.paths import Paths
        from cella.runtime.qemu.driver import QemuDriver

        async def main():
            driver = QemuDriver(Paths.default())
            vm = await driver.boot()
            print(vm.pid, vm.directory, flush=True)
            await asyncio.sleep(600)

        asyncio.run(main())
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        qemu_pid_s, directory = proc.stdout.readline().split()
        qemu_pid = int(qemu_pid_s)
        assert not _gone(qemu_pid)
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 10
    while not _gone(qemu_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(qemu_pid)
    import shutil

    shutil.rmtree(directory, ignore_errors=True)


async def test_invalid_resources_are_refused_before_anything_starts(driver: QemuDriver) -> None:
    # shapes are checked once, by the request model every API path goes through
    for bad in ({"vcpus": 0}, {"vcpus": 1000}, {"memory_mib": 64}):
        with pytest.raises(ValidationError, match=next(iter(bad))):
            SandboxCreate(**bad)  # type: ignore[arg-type]
    before = qemu_pids()
    with pytest.raises(errors.NotFound):
        await driver.boot("no-such-template")
    assert qemu_pids() == before


async def test_vcpus_and_memory_come_from_the_request(vm_factory: VMFactory) -> None:
    vm = await vm_factory(vcpus=2, memory_mib=384)
    r = await vm.agent.exec("nproc; grep MemTotal /proc/meminfo")
    nproc, mem = r.stdout.decode().splitlines()
    assert nproc == "2"
    total_kib = int(mem.split()[1])
    assert 300 * 1024 < total_kib <= 384 * 1024
