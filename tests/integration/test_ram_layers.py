"""RAM layers on real microVMs: a snapshot of a restored VM saves only the pages it wrote,
restores from the layer are exact and copy-on-write, a changed layer is refused, the base
lives as long as the layer, and flattening gives the same machine."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from cella import errors
from cella.runtime.qemu import snapshot
from cella.runtime.qemu.driver import QemuDriver
from cella.runtime.qemu.vm import QemuVM
from cella.service.warm import Shape, WarmSnapshots
from cella.storage.snapshots import SnapshotDir
from tests.vms import VMFactory

pytestmark = pytest.mark.vm

# 12 MiB of random bytes in the guest's RAM (tmpfs), their checksum on its disk, a process
SETUP = (
    "head -c 12M /dev/urandom > /dev/shm/blob && sha256sum /dev/shm/blob > /root/blob.sum"
    " && (sleep 10000 >/dev/null 2>&1 &) && sync"
)
CHECK = "sha256sum -c /root/blob.sum >/dev/null && pgrep -x sleep >/dev/null && echo same"


@pytest.fixture(scope="module")
async def base(driver: QemuDriver) -> SnapshotDir:
    return await WarmSnapshots(driver).ensure(Shape("default", 1, 512))


@pytest.fixture
async def work(driver: QemuDriver, tmp_path: Path) -> AsyncIterator[Path]:
    yield tmp_path
    for directory in (tmp_path / "vms").glob("*"):
        for pid in driver.stray_pids(set(), directory):
            await driver.kill_pid(pid, directory)


async def restored(driver: QemuDriver, snap: SnapshotDir, where: Path) -> QemuVM:
    return await driver.restore(snap, where / "vms" / os.urandom(4).hex())


async def check(vm: QemuVM) -> str:
    done = await vm.agent.exec(["/bin/sh", "-c", CHECK])
    return done.stdout.decode().strip()


async def restores_the_same(driver: QemuDriver, snap: SnapshotDir, where: Path) -> bool:
    """A VM restored from `snap` has SETUP's blob and process (and is gone again)."""
    vm = await restored(driver, snap, where)
    try:
        return await check(vm) == "same"
    finally:
        await vm.kill()


async def test_a_layer_holds_only_what_the_vm_wrote(
    driver: QemuDriver, base: SnapshotDir, work: Path
) -> None:
    parent = await restored(driver, base, work)
    try:
        assert (await parent.agent.exec(["/bin/sh", "-c", SETUP])).exit_code == 0
        snap = SnapshotDir(work / "s1")
        manifest, _ = await driver.snapshot_vm(parent, snap)
        assert snap.is_layered(manifest) and not snap.ram.exists()
        # the 12 MiB written and a little more; nowhere near the 512 MiB of RAM
        assert 12 << 20 <= manifest["layer_bytes"] < 64 << 20
        assert os.stat(snap.ram_base).st_ino == os.stat(base.ram).st_ino
        # control: a VM that did not write the 12 MiB has less to save
        idle = await restored(driver, base, work)
        idle_manifest, _ = await driver.snapshot_vm(idle, SnapshotDir(work / "s-idle"))
        assert idle_manifest["layer_bytes"] < 12 << 20
        await idle.kill()
        # the parent changes on; its snapshot does not
        await parent.agent.exec(["/bin/sh", "-c", "echo other > /dev/shm/blob; pkill -x sleep"])
        assert await check(parent) == ""
        children = [await restored(driver, snap, work) for _ in range(2)]
        assert [await check(c) for c in children] == ["same", "same"]
        # copy-on-write: what one child writes, the other does not see
        await children[0].agent.exec(["/bin/sh", "-c", "echo mine > /dev/shm/blob"])
        assert [await check(c) for c in children] == ["", "same"]
        for child in children:
            await child.kill()
    finally:
        await parent.kill()


async def test_layer_survives_its_base_and_flattens_to_the_same_machine(
    driver: QemuDriver, base: SnapshotDir, work: Path
) -> None:
    # a base of our own, so it can be deleted: a flat snapshot of a restored VM
    first = await restored(driver, base, work)
    mid = SnapshotDir(work / "mid")
    await driver.snapshot_vm(first, mid)
    await first.kill()
    await driver.flatten(mid)
    assert not mid.is_layered() and mid.ram.exists()

    vm = await restored(driver, mid, work)
    assert (await vm.agent.exec(["/bin/sh", "-c", SETUP])).exit_code == 0
    top = SnapshotDir(work / "top")
    await driver.snapshot_vm(vm, top)
    await vm.kill()
    assert os.stat(top.ram_base).st_nlink == 2  # the base's name and the layer's link

    # the base's RAM file loses its own name (its disk stays: the layer's disk sits on it);
    # the layer keeps the file
    mid.ram.unlink()
    assert os.stat(top.ram_base).st_nlink == 1
    child = await restored(driver, top, work)
    assert await check(child) == "same"

    manifest = await driver.flatten(top)
    assert not top.is_layered(manifest)
    # the child's RAM file has no name left to link a layer to: its snapshot is a whole
    # one (the RAM migrated out), still exact
    whole = SnapshotDir(work / "whole")
    await driver.snapshot_vm(child, whole)
    await child.kill()
    assert not whole.is_layered() and whole.ram.exists()
    assert await restores_the_same(driver, whole, work)
    assert sorted(p.name for p in top.path.iterdir()) == [
        "disk.qcow2",
        "manifest.json",
        "ram",
        "state",
    ]
    flat = await restored(driver, top, work)
    assert await check(flat) == "same"
    # and a layer over the flattened snapshot restores as well
    again = SnapshotDir(work / "again")
    await driver.snapshot_vm(flat, again)
    await flat.kill()
    assert again.is_layered()
    assert await restores_the_same(driver, again, work)


async def test_a_changed_layer_is_refused(
    driver: QemuDriver, base: SnapshotDir, work: Path
) -> None:
    vm = await restored(driver, base, work)
    assert (await vm.agent.exec(["/bin/sh", "-c", SETUP])).exit_code == 0
    snap = SnapshotDir(work / "s")
    await driver.snapshot_vm(vm, snap)
    await vm.kill()
    layer = snap.path / "ram.layer"
    layer.chmod(0o600)
    with layer.open("r+b") as f:
        f.seek(5 << 20)
        byte = f.read(1)
        f.seek(5 << 20)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(errors.SnapshotCorrupt, match=r"ram\.layer"):
        await restored(driver, snap, work)
    with pytest.raises(errors.SnapshotCorrupt, match=r"ram\.layer"):
        await driver.flatten(snap)
    assert snap.is_layered() and not snap.ram.exists()  # nothing half-flattened
    # control: the byte put back, the same layer restores
    with layer.open("r+b") as f:
        f.seek(5 << 20)
        f.write(byte)
    assert await restores_the_same(driver, snap, work)


async def test_a_booted_vm_is_snapshotted_whole(
    driver: QemuDriver, vm_factory: VMFactory, work: Path
) -> None:
    # a cold boot (a stopped sandbox resumed) has no RAM file to layer over: its whole RAM
    # migrates to a helper QEMU, whose RAM is a file
    vm = await vm_factory(memory_mib=512, name=f"boot-{os.urandom(3).hex()}")
    assert (await vm.agent.exec(["/bin/sh", "-c", SETUP])).exit_code == 0
    snap = SnapshotDir(work / "booted")
    manifest, _ = await driver.snapshot_vm(vm, snap)
    assert not snap.is_layered(manifest) and snap.ram.exists()
    await driver.destroy(vm)
    child = await restored(driver, snap, work)
    assert await check(child) == "same"
    # and the child, restored, is snapshotted as a layer over that file
    again = SnapshotDir(work / "layer-on-booted")
    await driver.snapshot_vm(child, again)
    await child.kill()
    assert again.is_layered()
    assert await restores_the_same(driver, again, work)


async def test_a_layer_too_large_to_hold_is_written_during_the_pause(
    driver: QemuDriver, base: SnapshotDir, work: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(snapshot, "LAYER_IN_MEMORY", 1 << 20)  # the 12 MiB do not fit
    vm = await restored(driver, base, work)
    assert (await vm.agent.exec(["/bin/sh", "-c", SETUP])).exit_code == 0
    snap = SnapshotDir(work / "large")
    manifest, _ = await driver.snapshot_vm(vm, snap)
    await vm.kill()
    assert manifest["layer_bytes"] >= 12 << 20
    assert (snap.path / "ram.layer").stat().st_size == manifest["layer_bytes"]
    assert await restores_the_same(driver, snap, work)
