"""The QEMU microVM driver: overlay on a template base, boot, stop, destroy."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import os
import re
import secrets
import shutil
import signal
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from cella import errors
from cella._proc import Progress, quiet
from cella.images.boot import BootImage, ensure_boot
from cella.images.kernel import Kernel
from cella.images.templates import builtin_templates, find_template, start_of
from cella.paths import Paths
from cella.runtime.cgroups import CpuLimiter
from cella.runtime.contract import VM, AccelChoice
from cella.runtime.qemu import ramdiff
from cella.runtime.qemu.accel import AccelMode, choose_accel, qemu_accel
from cella.runtime.qemu.args import QEMU, VMConfig
from cella.runtime.qemu.jail import Jail, JailIds, ensure_jailer, process_uid
from cella.runtime.qemu.snapshot import (
    flatten_snapshot,
    snapshot_disk,
    snapshot_fresh_boot,
    snapshot_running,
    snapshot_stopped,
)
from cella.runtime.qemu.vm import QemuVM, VMFiles, pid_alive, qemu_cmdline, socket_dir
from cella.storage.overlay import create_overlay, image_info, overlay_bytes
from cella.storage.snapshots import SnapshotDir

MIN_MEMORY_MIB = 128  # the shape of an adopted VM whose command line says nothing
DISK = "disk.qcow2"
TOP = "disk.top.qcow2"  # the overlay a move's pre-copy puts over DISK (`split_disk`)
_RAM_FILE = re.compile(r"memory-backend-file,[^ ]*mem-path=([^, ]+),share=(on|off)")


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _arg(argv: list[str], flag: str, default: str) -> str:
    """The value after `flag` in a QEMU command line."""
    return argv[argv.index(flag) + 1] if flag in argv[:-1] else default


def _memory_mib(argv: list[str]) -> int:
    value = _arg(argv, "-m", f"{MIN_MEMORY_MIB}M")
    return int(value.rstrip("M"))


class QemuDriver:
    """Boots microVMs from templates. `prepare()` once, then `boot()` many times.

    Implements `cella.runtime.contract.Driver`; shapes (vCPUs, RAM) are validated by the
    request models before they get here."""

    def __init__(
        self,
        paths: Paths,
        accel: AccelMode = "auto",
        *,
        die_with_parent: bool = True,
        extra_ca: bytes = b"",
        jail: JailIds | None = None,
        seccomp: bool = True,
    ) -> None:
        self.paths = paths
        self.seccomp = seccomp
        self.jail_ids = jail
        self.jail: Jail | None = None  # made by prepare(), once the accelerator is known
        self.extra_ca = extra_ca  # CAs every guest trusts, from its template's warm snapshot
        self.accel_mode: AccelMode = accel
        self.die_with_parent = die_with_parent
        self._boot: BootImage | None = None
        self._accel: AccelChoice | None = None
        self.cpu = CpuLimiter()
        self._disk_mib: dict[Path, int] = {}
        self._restoring: Counter[Path] = Counter()  # restores in flight, per snapshot
        self._flattening: defaultdict[Path, asyncio.Lock] = defaultdict(asyncio.Lock)

    def _limit(self, vm: QemuVM) -> QemuVM:
        """Puts a started VM in its own CPU cgroup, released when the VM is killed."""
        if vm.pid is not None:
            self.cpu.apply(vm.config.name, vm.pid, vm.config.vcpus)
            vm.exit_hooks.append(lambda: self.cpu.remove(vm.config.name))
        return vm

    async def prepare(self, progress: Progress = quiet) -> AccelChoice:
        """Builds the boot image if its sources changed and settles on an accelerator.

        Done once per driver: later calls return at once (they sit on the create path).
        """
        if self._boot is not None and self._accel is not None:
            return self._accel
        self.paths.ensure()
        self._boot = ensure_boot(self.paths, progress)
        self._accel = await choose_accel(self._boot, self.accel_mode, self.paths.images)
        if self.jail_ids is not None:
            jailer = ensure_jailer(self.paths, progress)
            self.jail = Jail(jailer, self.jail_ids, self._accel.accel)
        return self._accel

    async def refresh_boot(self) -> bool:
        """Moves new VMs onto a better kernel once it is there (the tuned one, compiled in
        the background, after the stock one). VMs and snapshots keep the kernel they have.
        Returns whether it switched."""
        if self._boot is None or self._accel is None:
            return False
        kernel = await asyncio.to_thread(Kernel.load, self.paths)
        if kernel.sha256 == self._boot.kernel.sha256:
            return False
        boot = await asyncio.to_thread(ensure_boot, self.paths)
        accel = await choose_accel(boot, self.accel_mode, self.paths.images)
        self._boot, self._accel = boot, accel  # together: a create sees one or the other
        return True

    @property
    def kernel(self) -> Kernel:
        if self._boot is None:
            raise errors.CellaError("driver not prepared")
        return self._boot.kernel

    @property
    def accel(self) -> AccelChoice:
        if self._accel is None:
            raise errors.CellaError("driver not prepared")
        return self._accel

    async def boot(
        self,
        template: str = "default",
        *,
        vcpus: int = 1,
        memory_mib: int = 512,
        disk_mib: int | None = None,
        name: str | None = None,
        boot_timeout: float = 60.0,
    ) -> QemuVM:
        """A new VM on a fresh overlay of the template (removed again if the boot fails)."""
        base = find_template(self.paths, template)
        name = name or f"vm-{secrets.token_hex(6)}"
        directory = self.paths.vms / name
        directory.mkdir(parents=True)
        try:
            create_overlay(base, directory / DISK, disk_mib)
            return await self.start(
                directory,
                vcpus=vcpus,
                memory_mib=memory_mib,
                boot_timeout=boot_timeout,
            )
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise

    async def start(
        self,
        directory: Path,
        *,
        vcpus: int,
        memory_mib: int,
        boot_timeout: float = 60.0,
        disk: str = DISK,
    ) -> QemuVM:
        """Boots a VM on the overlay already in `directory` (create, or resume after stop)."""
        if self._boot is None or self._accel is None:
            await self.prepare()
        assert self._boot is not None and self._accel is not None
        await self.merge_disk(directory)  # left split by a move that did not end
        config = self._config(directory, vcpus, memory_mib)
        config = dataclasses.replace(config, disk=directory / disk)
        vm = QemuVM(config, die_with_parent=self.die_with_parent, jail=self.jail)
        vm.directory = directory
        vm.accel_reason = self._accel.reason
        await vm.start(boot_timeout)
        return self._limit(vm)

    async def adopt(self, directory: Path, pid: int, paused: bool = False) -> QemuVM:
        """Reconnects to a VM left running by an earlier daemon (its QEMU must be ours)."""
        if f"file={directory}/" not in " ".join(qemu_cmdline(pid)):
            raise errors.SandboxCrashed(f"process {pid} is not the QEMU of {directory.name}")
        argv = qemu_cmdline(pid)
        # the shape it was started with: a later snapshot's helper must match it exactly
        config = dataclasses.replace(
            self._config(directory, int(_arg(argv, "-smp", "1")), _memory_mib(argv)),
            kernel=Path(
                _arg(argv, "-kernel", str(self._boot.kernel.vmlinux if self._boot else "/"))
            ),
            initrd=Path(_arg(argv, "-initrd", str(self._boot.initrd if self._boot else "/"))),
            # the RAM file it was restored from: a later snapshot is a layer over it
            ram_file=Path(ram[1]) if (ram := _RAM_FILE.search(" ".join(argv))) else None,
            ram_shared=bool(ram and ram[2] == "on"),
            devices_only="migration.send-configuration=off" in argv,
        )
        vm = await QemuVM.adopt(config, pid, paused=paused)
        vm.directory = directory
        if self.jail is not None and (uid := process_uid(pid)):
            jail = self.jail
            jail.adopt(config.name, uid)
            vm.exit_hooks.append(lambda: jail.release(config.name))
        vm.accel_reason = self._accel.reason if self._accel else ""
        vm.exit_hooks.append(lambda: self.cpu.remove(vm.config.name))
        if (directory / TOP).exists():  # split by a move the earlier daemon did not end
            vm.config = dataclasses.replace(vm.config, disk=directory / TOP)
            await self.merge_disk(directory, vm)
        return vm

    # -- a move's disk pre-copy -------------------------------------------------------------

    async def split_disk(self, vm: VM) -> None:
        """A new, empty overlay over the disk the VM writes: its directory's disk file
        keeps what the guest wrote so far and is not written again until `merge_disk`
        (a move copies it while the guest runs)."""
        assert isinstance(vm, QemuVM) and vm.directory is not None
        if vm.config.disk != vm.directory / DISK:
            raise errors.InvalidState(f"the disk of {vm.name} is split already")
        (vm.directory / TOP).unlink(missing_ok=True)
        await vm.split_disk(vm.directory / TOP)

    def memory_base(self, vm: VM) -> Path | None:
        """The RAM file a restored VM maps privately, if it still has that name."""
        assert isinstance(vm, QemuVM)
        ram = vm.config.ram_file
        if ram is None or vm.config.ram_shared or vm.pid is None:
            return None
        try:
            ramdiff.ram_mapping(vm.pid, ram)  # the file by that name is the one mapped
        except (OSError, FileNotFoundError):
            return None
        return ram

    async def merge_disk(self, directory: Path, vm: VM | None = None) -> None:
        """Undoes `split_disk`: the overlay written back into the disk below (live through
        QEMU with `vm`, else with `qemu-img commit`) and removed. Nothing to do if the disk
        is not split."""
        top = directory / TOP
        if not top.exists():
            return
        if vm is not None:
            assert isinstance(vm, QemuVM)
            if vm.config.disk == top:
                await vm.merge_disk(directory / DISK)
        else:
            await _run("qemu-img", "commit", "-q", "-f", "qcow2", str(top))
        top.unlink(missing_ok=True)

    def _config(
        self,
        directory: Path,
        vcpus: int,
        memory_mib: int,
        ram_file: Path | None = None,
        ram_shared: bool = False,
        incoming: str | None = None,
    ) -> VMConfig:
        files = VMFiles.under(directory)
        boot = self._boot
        return VMConfig(
            ram_file=ram_file,
            ram_shared=ram_shared,
            incoming=incoming,
            name=directory.name,
            vcpus=vcpus,
            memory_mib=memory_mib,
            kernel=boot.kernel.vmlinux if boot else Path("/"),
            initrd=boot.initrd if boot else Path("/"),
            disk=directory / DISK,
            accel=qemu_accel(self._accel) if self._accel else "tcg",
            qmp_socket=files.qmp_socket,
            agent_socket=files.agent_socket,
            console_log=files.console_log,
            seccomp=self.seccomp,
        )

    # -- snapshots ------------------------------------------------------------------------

    async def snapshot_template(
        self,
        template: str,
        dest: SnapshotDir,
        *,
        vcpus: int,
        memory_mib: int,
        boot_timeout: float = 60.0,
    ) -> dict[str, Any]:
        """The warm snapshot new sandboxes of this template and shape restore from."""
        await self._ensure_prepared()
        base = find_template(self.paths, template)
        meta = self._snapshot_meta(vcpus, memory_mib, template=template)
        return await snapshot_fresh_boot(
            lambda d, ram, shared: self._config(d, vcpus, memory_mib, ram, shared),
            base,
            dest,
            meta,
            boot_timeout,
            extra_ca=self.extra_ca,
            warm=spec.warm if (spec := builtin_templates().get(template)) else [],
            start=start_of(self.paths, template),
            jail=self.jail,
        )

    async def snapshot_vm(
        self,
        vm: VM,
        dest: SnapshotDir,
        *,
        memory: bool = True,
        leave_paused: bool = False,
        **meta: Any,
    ) -> tuple[dict[str, Any], float]:
        """Snapshots a running VM (disk and memory, or with `memory=False` its disk only);
        returns the manifest and pause time."""
        await self._ensure_prepared()
        assert isinstance(vm, QemuVM)
        cfg = vm.config
        full_meta = {
            **self._snapshot_meta(cfg.vcpus, cfg.memory_mib),
            "kernel": str(cfg.kernel),
            "initrd": str(cfg.initrd),
            **meta,
        }
        if not memory:
            return await snapshot_disk(vm, dest, full_meta)
        return await snapshot_running(
            vm,
            dest,
            full_meta,
            lambda d, ram, shared: dataclasses.replace(
                self._config(d, cfg.vcpus, cfg.memory_mib, ram, shared),
                kernel=cfg.kernel,
                initrd=cfg.initrd,
                accel=cfg.accel,
            ),
            jail=self.jail,
            leave_paused=leave_paused,
        )

    async def snapshot_stopped(
        self, directory: Path, dest: SnapshotDir, *, vcpus: int, memory_mib: int, **meta: Any
    ) -> dict[str, Any]:
        """A stopped VM's overlay as a snapshot without memory (booted, not restored)."""
        await self._ensure_prepared()
        full_meta = self._snapshot_meta(vcpus, memory_mib, **meta)
        return await snapshot_stopped(directory / DISK, dest, full_meta)

    async def overlay_from(self, snap: SnapshotDir, directory: Path) -> None:
        """A VM directory with an overlay on the snapshot's disk, for `start` to boot."""
        await asyncio.to_thread(snap.verify)
        directory.mkdir(parents=True)
        try:
            create_overlay(snap.disk, directory / DISK)
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise

    async def restore(
        self,
        snap: SnapshotDir,
        directory: Path,
        timeout: float = 30.0,
        spare: VM | None = None,
    ) -> QemuVM:
        """A new VM from a snapshot (checked against its manifest first), on a new overlay.

        A layered snapshot maps its base RAM file and has its layer written into the new
        VM's memory before the vCPUs run. `spare`: a QEMU `prespawn` started for this
        snapshot in `directory`, which only has the state left to load."""
        await self._ensure_prepared()
        if spare is not None:
            return await self._finish_spare(snap, directory, spare, timeout)
        self._restoring[snap.path] += 1
        try:
            return await self._restore(snap, directory, timeout)
        finally:
            self._restoring[snap.path] -= 1
            if not self._restoring[snap.path]:
                del self._restoring[snap.path]

    async def boot_snapshot(
        self,
        snap: SnapshotDir,
        directory: Path,
        *,
        vcpus: int,
        memory_mib: int,
        boot_timeout: float = 60.0,
    ) -> QemuVM:
        """A VM booted afresh from a snapshot's disk (checked first), on a new overlay:
        its files, none of its memory (with or without a memory image)."""
        await self._ensure_prepared()
        await asyncio.to_thread(snap.verify)
        directory.mkdir(parents=True)
        try:
            create_overlay(snap.disk, directory / DISK)
            return await self.start(
                directory, vcpus=vcpus, memory_mib=memory_mib, boot_timeout=boot_timeout
            )
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise

    async def prespawn(self, snap: SnapshotDir, directory: Path) -> QemuVM:
        """A QEMU started ahead for a later restore of `snap` into `directory`: its disk
        overlay made, the snapshot's RAM mapped, QMP and the agent channel connected,
        waiting for the state (what a restore spends most of its time on before loading).
        Whole snapshots only: a layer is written into RAM just before its state loads."""
        await self._ensure_prepared()
        manifest = snap.verify()
        if snap.is_layered(manifest):
            raise errors.InvalidArgument(f"{snap.path.name} is layered: no spare for it")
        vm = self._incoming(snap, manifest, directory, snap.ram)
        try:
            await vm.await_incoming()
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        vm.spare_of = snap.path
        return vm

    async def _finish_spare(
        self, snap: SnapshotDir, directory: Path, spare: VM, timeout: float
    ) -> QemuVM:
        assert isinstance(spare, QemuVM)
        if spare.spare_of != snap.path or spare.directory != directory or not spare.usable:
            await self.destroy(spare)
            raise errors.InvalidArgument(f"the spare QEMU is not one for {snap.path.name}")
        try:
            snap.verify()  # the files may have changed since the spare mapped them
        except BaseException:
            await self.destroy(spare)
            raise
        spare.spare_of = None
        spare.restore_spans.clear()  # its start and overlay were made ahead, off this path
        spare.mark_cpu()
        try:
            await spare.load(snap.state, timeout)
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        return self._limit(spare)

    def _incoming(
        self, snap: SnapshotDir, manifest: dict[str, Any], directory: Path, ram: Path
    ) -> QemuVM:
        """A VM (not started) that will wait for `snap`'s state, on a new overlay."""
        started = time.perf_counter()
        directory.mkdir(parents=True)
        try:
            create_overlay(snap.disk, directory / DISK)
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        overlay = time.perf_counter() - started
        config = dataclasses.replace(
            self._config(directory, manifest["vcpus"], manifest["memory_mib"], ram, False, "defer"),
            kernel=Path(manifest["kernel"]),
            initrd=Path(manifest["initrd"]),
            accel=manifest["accel"],
            devices_only=bool(manifest.get("devices_only")),
        )
        vm = QemuVM(config, die_with_parent=self.die_with_parent, jail=self.jail)
        vm.directory = directory
        vm.accel_reason = self._accel.reason if self._accel else ""
        vm.restore_spans["overlay"] = overlay
        return vm

    async def _restore(self, snap: SnapshotDir, directory: Path, timeout: float) -> QemuVM:
        manifest = snap.verify()
        layered = snap.is_layered(manifest)
        ram = snap.ram_base if layered else snap.ram
        if layered and _same_file(origin := Path(manifest.get("ram_base", "/")), ram):
            ram = origin  # the base under its own name, which outlives this layer's link

        def prefill(pid: int) -> None:
            ramdiff.load_layer(pid, ramdiff.ram_mapping(pid, ram), snap.path)

        vm = self._incoming(snap, manifest, directory, ram)
        try:
            await vm.restore(snap.state, timeout, prefill if layered else None)
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        return self._limit(vm)

    async def flatten(self, snap: SnapshotDir) -> dict[str, Any]:
        """Gives a layered snapshot a RAM file of its own (its base may go then); restores
        from it share that file's pages instead of each holding a copy of the layer."""

        async def no_restores() -> None:
            while self._restoring.get(snap.path):
                await asyncio.sleep(0.005)

        async with self._flattening[snap.path]:
            return await flatten_snapshot(snap, no_restores)

    def _snapshot_meta(self, vcpus: int, memory_mib: int, **extra: Any) -> dict[str, Any]:
        assert self._boot is not None and self._accel is not None
        return {
            "vcpus": vcpus,
            "memory_mib": memory_mib,
            "accel": self._accel.accel,
            "kernel": str(self._boot.kernel.vmlinux),
            "initrd": str(self._boot.initrd),
            **extra,
        }

    async def _ensure_prepared(self) -> None:
        if self._boot is None or self._accel is None:
            await self.prepare()

    def stray_pids(self, keep: set[int], directory: Path | None = None) -> list[int]:
        """QEMU processes running VMs of this data directory (or only the VM in
        `directory`) that nothing owns."""
        marker = f"file={directory or self.paths.vms}/"
        strays = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) not in keep:
                argv = qemu_cmdline(int(entry))
                if argv and argv[0].endswith(QEMU) and marker in " ".join(argv):
                    strays.append(int(entry))
        return strays

    async def kill_pid(self, pid: int, directory: Path | None = None) -> None:
        """SIGKILLs a left-behind QEMU and waits for it to go. With `directory`, only if it
        still runs that VM (the pid may have been reused)."""
        if directory is not None and f"file={directory}/" not in " ".join(qemu_cmdline(pid)):
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        for _ in range(250):
            if not pid_alive(pid):
                return
            await asyncio.sleep(0.02)

    def template_disk_mib(self, template: str) -> int:
        base = find_template(self.paths, template)
        if base not in self._disk_mib:  # bases are content-addressed: asked once (qemu-img)
            self._disk_mib[base] = int(str(image_info(base)["virtual-size"])) >> 20
        return self._disk_mib[base]

    def warm_key(self, template: str, vcpus: int, memory_mib: int) -> str:
        meta = self._snapshot_meta(vcpus, memory_mib)
        parts = [find_template(self.paths, template).name, meta["kernel"], meta["initrd"]]
        parts += [meta["accel"], str(vcpus), str(memory_mib)]
        if self.extra_ca:  # a changed CA set means new warm snapshots
            parts.append(hashlib.sha256(self.extra_ca).hexdigest())
        if started := start_of(self.paths, template):  # and so does a new start command
            start, config = started
            parts.append(
                hashlib.sha256(
                    f"{start.model_dump_json()}{config.model_dump_json()}".encode()
                ).hexdigest()
            )
        return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]

    def cpu_seconds(self, vm: VM) -> float | None:
        if vm.pid is None:
            return None
        return self.cpu.cpu_seconds(vm.name) or _proc_cpu(vm.pid)

    def host_memory_mib(self, vm: VM) -> float | None:
        return _pss_mib(vm.pid) if vm.pid is not None else None

    def disk_bytes(self, directory: Path) -> int:
        return overlay_bytes(directory)

    def clear_sockets(self, directory: Path) -> None:
        shutil.rmtree(socket_dir(directory), ignore_errors=True)

    async def destroy(self, vm: VM) -> None:
        """Kills the VM and frees its overlay and sockets."""
        await vm.kill()
        if vm.directory is not None:
            self.remove_directory(vm.directory)

    def remove_directory(self, directory: Path) -> None:
        """Removes a VM's directory (overlay, console log) and its socket directory."""
        if directory.resolve().is_relative_to(self.paths.vms.resolve()):
            self.clear_sockets(directory)
            shutil.rmtree(directory, ignore_errors=True)

    def leftovers(self) -> list[str]:
        """VM directories on disk (for tests and recovery)."""
        return sorted(os.listdir(self.paths.vms)) if self.paths.vms.exists() else []


async def _run(*argv: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
    )
    _, err = await proc.communicate()
    if proc.returncode != 0:
        raise errors.CellaError(f"{argv[0]} {argv[1]} failed: {err.decode(errors='replace')}")


def _proc_cpu(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None
