"""Memory snapshots: save a VM's RAM, devices and disk at one instant; restore in milliseconds.

Restored VMs map the snapshot's RAM file privately (copy-on-write), so pages they do not
change stay shared between them, and their disks are overlays on the snapshot's frozen disk.
A snapshot of such a VM saves only the pages it wrote, as a layer over that RAM file
(`ramdiff`), and is flattened into a RAM file of its own afterwards (`flatten_snapshot`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import secrets
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from cella import errors
from cella.guest.start import start as start_command
from cella.guest.trust import trust
from cella.models import ImageConfig, StartCommand
from cella.runtime.qemu import ramdiff
from cella.runtime.qemu.args import VMConfig
from cella.runtime.qemu.jail import Jail
from cella.runtime.qemu.vm import QemuVM, socket_dir
from cella.storage.overlay import create_overlay
from cella.storage.snapshots import SHARED, SnapshotDir, sha256_of

# a layer up to this size is read into the daemon's memory while the VM is paused and
# written out after it runs again; a larger one is written during the pause (the daemon's
# memory stays bounded when many sandboxes are snapshotted at once)
LAYER_IN_MEMORY = 256 << 20


def _tmp_dir(dest: SnapshotDir) -> Path:
    tmp = dest.path.with_name(f".{dest.path.name}.tmp-{os.getpid()}-{secrets.token_hex(3)}")
    tmp.mkdir(parents=True)
    return tmp


def _finish(tmp: Path, dest: SnapshotDir, meta: dict[str, Any]) -> dict[str, Any]:
    for leftover in ("console.log", "blank.qcow2"):
        (tmp / leftover).unlink(missing_ok=True)
    # written by a jailed QEMU as its own uid: the snapshot is the daemon's, not that uid's
    # (which a later VM gets)
    for path in (tmp, *tmp.iterdir()):
        if path.name not in SHARED:
            os.chown(path, 0, 0)
    manifest = SnapshotDir(tmp).seal(meta)
    if dest.path.exists():  # someone else finished the same snapshot first
        shutil.rmtree(tmp, ignore_errors=True)
        return dest.manifest()
    tmp.rename(dest.path)
    return manifest


async def snapshot_fresh_boot(
    config_for: Any,
    base: Path,
    dest: SnapshotDir,
    meta: dict[str, Any],
    boot_timeout: float,
    *,
    extra_ca: bytes = b"",
    warm: list[str] | None = None,
    start: tuple[StartCommand, ImageConfig] | None = None,
    jail: Jail | None = None,
) -> dict[str, Any]:
    """A template's warm snapshot: boot with RAM in a shared file, warm it, save devices.

    `config_for(directory, ram_file, shared)` builds the VM config for this host; the guest
    trusts `extra_ca` (the operator's CAs) from then on, and the template's `warm` commands
    have run (what they start runs on in every restored sandbox), and so has its `start`
    command, until its ready command succeeded.
    """
    tmp = _tmp_dir(dest)
    vm: QemuVM | None = None
    try:
        create_overlay(base, tmp / "disk.qcow2")
        config: VMConfig = config_for(tmp, tmp / "ram", True)
        vm = QemuVM(config, jail=jail)
        await vm.start(boot_timeout)
        if extra_ca:
            await trust(vm.agent, "cella-extra", extra_ca)
        for command in warm or []:
            done = await vm.agent.exec(["/bin/sh", "-c", command], timeout=600)
            if done.exit_code != 0:
                tail = (done.stdout + done.stderr).decode(errors="replace")[-2000:]
                raise errors.BuildFailed(f"warm-up {command!r} exited {done.exit_code}: {tail}")
        if start is not None:
            await start_command(vm.agent, *start)
        # warm the page cache and TCG with what sandboxes run first; restores inherit it
        # (best effort: an image may have no shell or no python)
        with contextlib.suppress(errors.CellaError):
            await vm.agent.exec("python3 -c pass; true", timeout=60)
        with contextlib.suppress(errors.CellaError):
            await vm.agent.exec(["sync"], timeout=60)
        await vm.save_state(tmp / "state", ignore_shared=True)
        await vm.kill()
        vm = None
        return _finish(tmp, dest, meta)
    except BaseException:
        if vm is not None:
            await vm.kill()
        shutil.rmtree(tmp, ignore_errors=True)
        raise


async def snapshot_running(
    vm: QemuVM,
    dest: SnapshotDir,
    meta: dict[str, Any],
    config_for: Any,
    jail: Jail | None = None,
    *,
    leave_paused: bool = False,
) -> tuple[dict[str, Any], float]:
    """Snapshots a running VM; returns the manifest and how long the VM was paused
    (`leave_paused`: it stays paused after, as it was at the snapshot's instant: a move
    ships that state and must not let the guest run on here).

    A VM restored from a snapshot is saved as a layer over the RAM file it maps
    (`_snapshot_layered`). Otherwise the VM is paused, its RAM sent to a helper QEMU and
    its disk overlay (flushed by the migration) copied as the snapshot's disk; then it runs
    on. The helper writes the RAM into a shareable file and saves the device state; forks
    restore from those.

    The VM stays paused for the whole RAM transfer. Letting it run during the copy (live
    migration) produced corrupted forks under TCG here - guest kernel panics and a crashed
    init in most of a dozen forks - so it is not done.
    """
    await sync_guest(vm, required=False)  # its disk stands alone too (restore "never")
    tmp = _tmp_dir(dest)
    base = vm.config.ram_file
    if base is not None and not vm.config.ram_shared and vm.pid is not None:
        try:
            os.link(base, tmp / "ram.base")  # the layer keeps its base alive
        except OSError:  # gone (a layer flattened since) or on another file system
            pass
        else:
            try:
                return await _snapshot_layered(vm, base, tmp, dest, meta, leave_paused)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
    helper: QemuVM | None = None
    try:
        current = vm.config.disk
        assert current is not None
        # the helper never runs the guest: any disk satisfies its device model
        blank = tmp / "blank.qcow2"
        await _qemu_img("create", "-q", "-f", "qcow2", str(blank), "1G")
        helper_cfg: VMConfig = config_for(tmp, tmp / "ram", True)
        mig_sock = socket_dir(tmp) / "migration"
        helper_cfg = dataclasses.replace(
            helper_cfg,
            disk=blank,
            incoming=f"unix:{mig_sock}",
            paused=True,
            name=f"{vm.config.name}-snap",
            # a VM restored from a device state sends no configuration section either
            devices_only=vm.config.devices_only,
        )
        helper = QemuVM(helper_cfg, jail=jail)
        await helper.spawn_listening(mig_sock)
        loop = asyncio.get_running_loop()
        paused_at = loop.time()
        await vm.pause()
        try:
            await vm.migrate_to(mig_sock)
            # stopped, disks flushed: the overlay is exactly what the RAM expects
            await _run(
                "cp", "--sparse=always", "--reflink=auto", str(current), str(tmp / "disk.qcow2")
            )
        finally:
            if not leave_paused:
                await vm.resume()
        paused = loop.time() - paused_at
        await helper.wait_incoming()
        await helper.save_state(tmp / "state", ignore_shared=True)
        await helper.kill()
        helper = None
        return _finish(tmp, dest, {**meta, "devices_only": vm.config.devices_only}), paused
    except BaseException:
        if helper is not None:
            await helper.kill()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(socket_dir(tmp), ignore_errors=True)


async def sync_guest(vm: QemuVM, *, required: bool) -> None:
    """Writes what the guest holds in its page cache to its disk, so the disk alone has
    every file (a boot from it, not only a restore of the memory, finds them). `required`:
    a guest that cannot sync fails the snapshot instead of leaving its disk short."""
    try:
        # a guest that stalls its sync holds up only its own best-effort snapshot briefly
        done = await vm.agent.exec(["sync"], timeout=120 if required else 10)
    except errors.CellaError as exc:
        if required:
            raise errors.CellaError(f"could not sync the guest's file systems: {exc}") from None
        return
    if done.exit_code != 0 and required:
        raise errors.CellaError(f"`sync` in the guest exited {done.exit_code}")


async def snapshot_disk(
    vm: QemuVM, dest: SnapshotDir, meta: dict[str, Any]
) -> tuple[dict[str, Any], float]:
    """The VM's disk alone (no memory): what the guest wrote is synced to it, then the VM is
    paused (QEMU drains and flushes its disks when it stops) while the overlay is copied.
    A sandbox made from it boots from the disk; nothing that ran is carried over."""
    assert vm.config.disk is not None
    await sync_guest(vm, required=True)
    tmp = _tmp_dir(dest)
    try:
        loop = asyncio.get_running_loop()
        paused_at = loop.time()
        await vm.pause()
        try:
            await _run(
                "cp",
                "--sparse=always",
                "--reflink=auto",
                str(vm.config.disk),
                str(tmp / "disk.qcow2"),
            )
        finally:
            await vm.resume()
        paused = loop.time() - paused_at
        return await asyncio.to_thread(_finish, tmp, dest, {**meta, "memory": False}), paused
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


async def snapshot_stopped(disk: Path, dest: SnapshotDir, meta: dict[str, Any]) -> dict[str, Any]:
    """A stopped VM's disk overlay (no QEMU holds it) as a snapshot without memory: what a
    move ships of a stopped sandbox."""
    tmp = _tmp_dir(dest)
    try:
        await _run("cp", "--sparse=always", "--reflink=auto", str(disk), str(tmp / "disk.qcow2"))
        return await asyncio.to_thread(_finish, tmp, dest, {**meta, "memory": False})
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


async def _snapshot_layered(
    vm: QemuVM,
    base: Path,
    tmp: Path,
    dest: SnapshotDir,
    meta: dict[str, Any],
    leave_paused: bool = False,
) -> tuple[dict[str, Any], float]:
    """The VM paused only while its device state, the pages it wrote since its restore and
    its disk overlay are copied out."""
    assert vm.pid is not None and vm.config.disk is not None
    pid, disk = vm.pid, vm.config.disk
    address = ramdiff.ram_mapping(pid, base)
    size = vm.config.memory_mib << 20

    def read_layer() -> tuple[ramdiff.Runs, list[bytes] | None]:
        runs = ramdiff.written_runs(pid, address, size)
        if ramdiff.layer_bytes(runs) > LAYER_IN_MEMORY:  # too much to hold: written now
            ramdiff.write_layer(runs, ramdiff.read_layer(pid, address, runs), tmp)
            return runs, None
        return runs, ramdiff.read_layer(pid, address, runs)

    loop = asyncio.get_running_loop()
    paused_at = loop.time()
    await vm.pause()
    try:
        await vm.save_devices(tmp / "state")
        # stopped, disks flushed: the overlay is exactly what the RAM expects
        (runs, pieces), _ = await asyncio.gather(
            asyncio.to_thread(read_layer),
            _run("cp", "--sparse=always", "--reflink=auto", str(disk), str(tmp / "disk.qcow2")),
        )
    finally:
        if not leave_paused:
            await vm.resume()
    paused = loop.time() - paused_at
    if pieces is not None:
        await asyncio.to_thread(ramdiff.write_layer, runs, pieces, tmp)
    del pieces
    layer_bytes = ramdiff.layer_bytes(runs)
    # the base's own name: restores map that, so a flatten (which unlinks ram.base) leaves
    # their RAM file with a name a later layer can link to
    meta = {**meta, "devices_only": True, "layer_bytes": layer_bytes, "ram_base": str(base)}
    return await asyncio.to_thread(_finish, tmp, dest, meta), paused


async def flatten_snapshot(
    snap: SnapshotDir, quiet_for: Callable[[], Awaitable[None]] | None = None
) -> dict[str, Any]:
    """Makes a layered snapshot whole: `ram` is the base with the layer written over it,
    checked against the layer's checksums first. `quiet_for()` is awaited right before the
    files switch (restores of the layer in flight must finish opening it)."""
    manifest = await asyncio.to_thread(snap.verify)
    if not snap.is_layered(manifest):
        return manifest
    tmp = snap.path / "ram.tmp"
    try:
        await asyncio.to_thread(ramdiff.flatten, snap.ram_base, snap.path, tmp)
        await asyncio.to_thread(sha256_of, tmp)  # remembered: the switch below is quick
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if quiet_for is not None:
        await quiet_for()
    tmp.rename(snap.ram)
    return snap.mark_flat()


async def _qemu_img(*args: str) -> None:
    await _run("qemu-img", *args)


async def _run(*argv: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
    )
    _, err = await proc.communicate()
    if proc.returncode != 0:
        raise errors.CellaError(f"{argv[0]} {argv[1]} failed: {err.decode(errors='replace')}")
