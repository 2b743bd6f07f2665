"""An in-process `cella.runtime.contract.Driver`: VMs are objects, guests are dicts.

It exists so the service's decisions (state machine, admission, reaper, recovery) can be
tested in milliseconds. It is never used where a real microVM can be: the integration tests
drive the QEMU driver.
"""

from __future__ import annotations

import asyncio
import itertools
import shutil
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Mapping,
    Sequence,
)
from pathlib import Path
from typing import Any

from cella import errors
from cella.guest.client import ExecEvent, Output, Started
from cella.guest.protocol import Entry, ExitStatus
from cella.models.exec import ExecResult, OutputCollector
from cella.paths import Paths
from cella.runtime.contract import VM, AccelChoice
from cella.storage.snapshots import FILES, LAYERED_FILES, SnapshotDir

# A guest command: argv (or shell string) -> (exit code, stdout, stderr).
Handler = Callable[[Sequence[str] | str], Awaitable[tuple[int, bytes, bytes]]]


async def echo(argv: Sequence[str] | str) -> tuple[int, bytes, bytes]:
    text = argv if isinstance(argv, str) else " ".join(argv)
    return 0, text.encode(), b""


class FakeAgent:
    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.identity: dict[str, Any] = {}
        self.handler: Handler = echo
        self.fail_identity: BaseException | None = None
        self._closed = False
        self.execs: list[Sequence[str] | str] = []
        self.on_stream: Any = None
        self.on_exec_denied: Any = None
        self.exec_policy: tuple[bool, list[tuple[bool, str, str]]] | None = None
        self.on_procs: Any = None
        self.failure: Exception | None = None
        self._failed = asyncio.Event()

    @property
    def closed(self) -> bool:
        return self._closed

    def break_protocol(self) -> None:
        """The guest wrote garbage to its channel: the agent is unusable, the VM runs on."""
        self._closed = True
        self.failure = errors.AgentUnavailable("guest broke the protocol: garbage")
        self._failed.set()

    async def wait_closed(self) -> Exception:
        await self._failed.wait()
        assert self.failure is not None
        return self.failure

    async def exec_stream(
        self,
        argv: Sequence[str] | str,
        *,
        cwd: str | None = None,
        env: Any = None,
        user: str | None = None,
        stdin: bytes | AsyncIterable[bytes] | None = None,
        timeout: float | None = None,
        pty: tuple[int, int] | None = None,
        control: Any = None,
        exempt: bool = True,
        trace: int = 0,
    ) -> AsyncIterator[ExecEvent]:
        if self._closed:
            raise errors.SandboxCrashed("the VM is gone")
        self.execs.append(argv)
        yield Started(pid=100 + len(self.execs))
        code, out, err = await self.handler(argv)
        if out:
            yield Output("stdout", out)
        if err:
            yield Output("stderr", err)
        yield ExitStatus(code, None, False)

    async def exec(self, argv: Sequence[str] | str, **kwargs: Any) -> ExecResult:
        output = OutputCollector()
        status = ExitStatus(0, None, False)
        async for event in self.exec_stream(argv, **kwargs):
            if isinstance(event, Output):
                output.add(event.stream, event.data)
            elif isinstance(event, ExitStatus):
                status = event
        return output.result(status.exit_code, status.signal, status.timed_out, 1.0)

    async def set_exec_policy(
        self, deny_by_default: bool, rules: Sequence[tuple[bool, str, str]]
    ) -> None:
        self.exec_policy = (deny_by_default, list(rules))

    async def set_identity(self, **identity: Any) -> None:
        if self.fail_identity is not None:
            raise self.fail_identity
        self.identity = identity

    async def open_port(self, port: int, timeout: float = 10.0) -> Any:
        raise errors.GuestError(f"connect to port {port}: Connection refused")

    async def read_stream(self, path: str) -> AsyncIterator[bytes]:
        yield await self.read_file(path)

    async def read_file(self, path: str) -> bytes:
        if path not in self.files:
            raise errors.NotFound(f"{path}: no such file")
        return self.files[path]

    async def write_file(
        self,
        path: str,
        data: bytes | AsyncIterable[bytes] | Iterable[bytes],
        *,
        mode: int = 0o644,
        parents: bool = False,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        if isinstance(data, bytes):
            self.files[path] = data
        elif isinstance(data, AsyncIterable):
            self.files[path] = b"".join([c async for c in data])
        else:
            self.files[path] = b"".join(data)

    async def stat(self, path: str, *, metadata: bool = False) -> Entry:
        data = await self.read_file(path)
        return Entry(path.rsplit("/", 1)[-1], "file", 0o644, len(data), 0, 0, 0)

    async def list_dir(self, path: str, *, metadata: bool = False) -> list[Entry]:
        return [await self.stat(p) for p in self.files if p.startswith(path.rstrip("/") + "/")]

    async def mkdir(self, path: str, *, mode: int = 0o755, parents: bool = False) -> None:
        return None

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        self.files.pop(path, None)

    async def chmod(self, path: str, mode: int) -> None:
        return None

    async def tar_out(self, path: str) -> AsyncIterator[bytes]:
        yield b""

    async def tar_in(
        self, path: str, archive: bytes | AsyncIterable[bytes], *, timeout: float | None = None
    ) -> None:
        return None


class FakeVM:
    _pids = itertools.count(50000)

    def __init__(self, directory: Path, vcpus: int, memory_mib: int) -> None:
        self.directory: Path | None = directory
        self.boot_seconds: float | None = 0.01
        self.restore_spans: dict[str, float] = {}
        self.accel_reason = "fake"
        self.exit_hooks: list[Callable[[], None]] = []
        self._pid = next(self._pids)
        self._vcpus = vcpus
        self._memory_mib = memory_mib
        self._agent = FakeAgent()
        self._ended = asyncio.Event()
        self.spare_of: Path | None = None
        self.paused = False
        self.stopped_cleanly = False
        self.disk_mib: int | None = None

    name = property(lambda self: self.directory.name if self.directory else "vm")
    pid = property(lambda self: None if self._ended.is_set() else self._pid)
    accel = property(lambda self: "tcg")
    vcpus = property(lambda self: self._vcpus)
    memory_mib = property(lambda self: self._memory_mib)
    agent = property(lambda self: self._agent)
    running = property(lambda self: not self._ended.is_set())
    usable = property(lambda self: self.running and not self._agent.closed)

    def crash(self) -> None:
        """QEMU dies without being asked to."""
        self._agent._closed = True
        self._ended.set()

    async def wait(self) -> int:
        await self._ended.wait()
        return 0

    async def exit_reason(self) -> str:
        return "killed by the test"

    async def stop(self, timeout: float = 15.0) -> None:
        self.stopped_cleanly = True
        await self.kill()

    async def kill(self) -> None:
        self._agent._closed = True
        self._ended.set()
        hooks, self.exit_hooks = self.exit_hooks, []
        for hook in hooks:
            hook()

    async def pause(self) -> None:
        self.paused = True

    async def resume(self) -> None:
        self.paused = False

    async def grow_disk(self, size_mib: int) -> None:
        self.disk_mib = size_mib

    async def detach(self) -> None:
        return None

    def trim_console(self, limit: int) -> None:
        self.console_limit = limit


class FakeDriver:
    def __init__(self, root: Path, templates: dict[str, int] | None = None) -> None:
        self.paths = Paths(root, root / "images")
        self.paths.ensure()
        self.templates = templates or {"default": 2048}
        self.vms: list[FakeVM] = []
        # VM processes that outlived a daemon: pid -> directory (for adopt and strays)
        self.orphans: dict[int, Path] = {}
        self.flattened: list[str] = []  # snapshots flatten() was asked for
        self.layers = False  # snapshot_vm makes RAM layers (flattened by flatten())
        self.spares_used = 0  # restores that finished a prespawned VM
        self.cold_boots = 0  # VMs booted from a snapshot's disk alone
        self.flatten_gate: asyncio.Event | None = None  # holds flatten() until set
        self.killed: list[int] = []

    @property
    def accel(self) -> AccelChoice:
        return AccelChoice("tcg", "fake")

    async def prepare(self) -> AccelChoice:
        return self.accel

    def template_disk_mib(self, template: str) -> int:
        if template not in self.templates:
            raise errors.NotFound(f"unknown template {template!r}")
        return self.templates[template]

    def warm_key(self, template: str, vcpus: int, memory_mib: int) -> str:
        return f"{vcpus}-{memory_mib}"

    def _vm(self, directory: Path, vcpus: int, memory_mib: int) -> FakeVM:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "disk.qcow2").write_bytes(b"disk")
        vm = FakeVM(directory, vcpus, memory_mib)
        self.vms.append(vm)
        return vm

    async def start(
        self,
        directory: Path,
        *,
        vcpus: int,
        memory_mib: int,
        boot_timeout: float = 60.0,
        disk: str = "disk.qcow2",
    ) -> FakeVM:
        return self._vm(directory, vcpus, memory_mib)

    async def restore(
        self,
        snap: SnapshotDir,
        directory: Path,
        timeout: float = 30.0,
        spare: VM | None = None,
    ) -> FakeVM:
        manifest = snap.verify()
        if spare is not None:
            assert isinstance(spare, FakeVM) and spare.directory == directory
            assert spare.spare_of == snap.path, "a spare restored from another snapshot"
            spare.spare_of = None
            self.spares_used += 1
            return spare
        return self._vm(directory, manifest["vcpus"], manifest["memory_mib"])

    async def boot_snapshot(
        self,
        snap: SnapshotDir,
        directory: Path,
        *,
        vcpus: int,
        memory_mib: int,
        boot_timeout: float = 60.0,
    ) -> FakeVM:
        snap.verify()
        vm = self._vm(directory, vcpus, memory_mib)
        self.cold_boots += 1
        return vm

    async def snapshot_stopped(
        self, directory: Path, dest: SnapshotDir, *, vcpus: int, memory_mib: int, **meta: Any
    ) -> dict[str, Any]:
        dest.path.mkdir(parents=True, exist_ok=True)
        dest.disk.write_bytes(b"disk")
        boot = {"kernel": str(self.paths.root), "initrd": str(self.paths.root)}
        meta = {"vcpus": vcpus, "memory_mib": memory_mib, "memory": False, **boot, **meta}
        return dest.seal(meta)

    async def overlay_from(self, snap: SnapshotDir, directory: Path) -> None:
        snap.verify()
        directory.mkdir(parents=True)

    async def prespawn(self, snap: SnapshotDir, directory: Path) -> FakeVM:
        manifest = snap.verify()
        vm = self._vm(directory, manifest["vcpus"], manifest["memory_mib"])
        vm.spare_of = snap.path
        return vm

    async def adopt(self, directory: Path, pid: int, paused: bool = False) -> FakeVM:
        if self.orphans.get(pid) != directory:
            raise errors.SandboxCrashed(f"process {pid} is not the VM of {directory.name}")
        del self.orphans[pid]
        vm = FakeVM(directory, 1, 512)
        vm._pid = pid
        vm.paused = paused
        self.vms.append(vm)
        return vm

    def _seal(self, dest: SnapshotDir, meta: dict[str, Any]) -> dict[str, Any]:
        dest.path.mkdir(parents=True, exist_ok=True)
        for name in FILES:
            (dest.path / name).write_bytes(name.encode())
        return dest.seal(meta)

    async def snapshot_template(
        self,
        template: str,
        dest: SnapshotDir,
        *,
        vcpus: int,
        memory_mib: int,
        boot_timeout: float = 60.0,
    ) -> dict[str, Any]:
        return self._seal(dest, {"vcpus": vcpus, "memory_mib": memory_mib})

    async def snapshot_vm(
        self,
        vm: Any,
        dest: SnapshotDir,
        *,
        memory: bool = True,
        leave_paused: bool = False,
        **meta: Any,
    ) -> tuple[dict[str, Any], float]:
        # the boot files a snapshot names (which a node taking it in must have)
        boot = {"kernel": str(self.paths.root), "initrd": str(self.paths.root)}
        meta = {"vcpus": vm.vcpus, "memory_mib": vm.memory_mib, **boot, **meta}
        if leave_paused:
            vm.paused = True
        if not memory:
            dest.path.mkdir(parents=True, exist_ok=True)
            dest.disk.write_bytes(b"disk")
            return dest.seal(meta), 0.001
        if not self.layers:
            return self._seal(dest, meta), 0.001
        dest.path.mkdir(parents=True, exist_ok=True)  # a RAM layer, as a restored VM's is
        for name in LAYERED_FILES:
            (dest.path / name).write_bytes(name.encode())
        return dest.seal(meta), 0.001

    async def flatten(self, snap: SnapshotDir) -> dict[str, Any]:
        self.flattened.append(snap.path.name)
        if self.flatten_gate is not None:
            await self.flatten_gate.wait()
        if not snap.is_layered():
            return snap.manifest()
        snap.ram.write_bytes(b"ram")
        return snap.mark_flat()

    def stray_pids(self, keep: set[int], directory: Path | None = None) -> list[int]:
        return [
            pid
            for pid, where in self.orphans.items()
            if pid not in keep and (directory is None or where == directory)
        ]

    async def kill_pid(self, pid: int, directory: Path | None = None) -> None:
        if directory is None or self.orphans.get(pid) == directory:
            self.orphans.pop(pid, None)
            self.killed.append(pid)

    def cpu_seconds(self, vm: Any) -> float | None:
        return 1.5

    def host_memory_mib(self, vm: Any) -> float | None:
        return 20.0

    def disk_bytes(self, directory: Path) -> int:
        return sum(p.stat().st_blocks * 512 for p in directory.glob("*.qcow2"))

    async def destroy(self, vm: Any) -> None:
        await vm.kill()
        if vm.directory is not None:
            self.remove_directory(vm.directory)

    def remove_directory(self, directory: Path) -> None:
        shutil.rmtree(directory, ignore_errors=True)

    def clear_sockets(self, directory: Path) -> None:
        return None
