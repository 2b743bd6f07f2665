"""What the service layer may ask of a runtime: the `Driver` that makes VMs and the `VM` it
hands back, with its `GuestAgent`. Each backend under `cella.runtime` implements it (today
`runtime.qemu`; `runtime.select` picks one by the `runtime` setting); the service's unit
tests use an in-process fake. Everything here is public and names no backend's types: no
caller reaches into a VM's internals.
"""

from __future__ import annotations

from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Mapping,
    Sequence,
)
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from cella.guest.client import ExecControl, ExecEvent, GuestStream
    from cella.guest.protocol import Entry, ExecDenied, ProcRecord, ProcSummary
    from cella.images.kernel import Kernel
    from cella.models.exec import ExecResult
    from cella.paths import Paths
    from cella.storage.snapshots import SnapshotDir


@dataclass(frozen=True, slots=True)
class AccelChoice:
    """The accelerator a runtime's VMs run under (`kvm`, or a backend's own software
    emulation such as QEMU's `tcg`) and why it was chosen; shown on sandboxes and in health."""

    accel: str
    reason: str


class GuestAgent(Protocol):
    """The agent inside a VM: commands, files, and the connections the guest opens (each a
    `GuestStream` handed to `on_stream`; with none set they are refused). Guest errors
    arrive as `cella.errors`."""

    on_stream: Callable[[GuestStream], Awaitable[None]] | None
    on_exec_denied: Callable[[ExecDenied], None] | None  # the exec policy refused one
    # the processes of execs run with `trace` (records and summaries, as the guest sends them)
    on_procs: Callable[[list[ProcRecord | ProcSummary]], None] | None

    @property
    def closed(self) -> bool: ...

    @property
    def failure(self) -> Exception | None:
        """Why the channel closed (a crash, or a guest that broke the protocol)."""
        ...

    async def wait_closed(self) -> Exception: ...

    def exec_stream(
        self,
        argv: Sequence[str] | str,
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        user: str | None = None,
        stdin: bytes | AsyncIterable[bytes] | None = None,
        timeout: float | None = None,
        pty: tuple[int, int] | None = None,
        control: ExecControl | None = None,
        exempt: bool = True,
        trace: int = 0,
    ) -> AsyncIterator[ExecEvent]: ...

    async def open_port(self, port: int, timeout: float = 10.0) -> GuestStream:
        """A connection to a server listening on `port` of the guest's loopback."""
        ...

    async def exec(
        self,
        argv: Sequence[str] | str,
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        user: str | None = None,
        stdin: bytes | AsyncIterable[bytes] | None = None,
        timeout: float | None = None,
    ) -> ExecResult: ...

    async def set_identity(
        self,
        *,
        hostname: str | None = None,
        time_ns: int | None = None,
        seed: bytes | None = None,
        sandbox_id: str | None = None,
        pids_max: int | None = None,
    ) -> None: ...

    async def set_exec_policy(
        self, deny_by_default: bool, rules: Sequence[tuple[bool, str, str]]
    ) -> None: ...

    def read_stream(self, path: str) -> AsyncIterator[bytes]: ...

    async def read_file(self, path: str) -> bytes: ...

    async def write_file(
        self,
        path: str,
        data: bytes | AsyncIterable[bytes] | Iterable[bytes],
        *,
        mode: int = 0o644,
        parents: bool = False,
        metadata: Mapping[str, str] | None = None,
    ) -> None: ...

    async def list_dir(self, path: str, *, metadata: bool = False) -> list[Entry]: ...

    async def stat(self, path: str, *, metadata: bool = False) -> Entry: ...

    async def mkdir(self, path: str, *, mode: int = 0o755, parents: bool = False) -> None: ...

    async def remove(self, path: str, *, recursive: bool = False) -> None: ...

    async def chmod(self, path: str, mode: int) -> None: ...

    def tar_out(self, path: str) -> AsyncIterator[bytes]: ...

    async def tar_in(
        self, path: str, archive: bytes | AsyncIterable[bytes], *, timeout: float | None = None
    ) -> None: ...


class VM(Protocol):
    """One microVM. `exit_hooks` run once when it ends (kill, stop or crash)."""

    directory: Path | None
    boot_seconds: float | None  # restore/boot time; None for a VM claimed from the pool
    restore_spans: dict[str, float]  # where a restore's time went, seconds by step (if known)
    accel_reason: str
    exit_hooks: list[Callable[[], None]]

    @property
    def name(self) -> str: ...

    @property
    def pid(self) -> int | None: ...

    @property
    def accel(self) -> str: ...

    @property
    def vcpus(self) -> int: ...

    @property
    def memory_mib(self) -> int: ...

    @property
    def agent(self) -> GuestAgent: ...

    @property
    def running(self) -> bool: ...

    @property
    def usable(self) -> bool:
        """Running with its agent connected."""
        ...

    async def wait(self) -> int: ...

    async def exit_reason(self) -> str:
        """Why the VM ended, for an unexpected end (QEMU's last words, the guest console)."""
        ...

    async def stop(self, timeout: float = 15.0) -> None: ...

    async def kill(self) -> None: ...

    async def pause(self) -> None: ...

    async def resume(self) -> None: ...

    async def grow_disk(self, size_mib: int) -> None: ...

    async def detach(self) -> None:
        """Lets go of the VM without stopping it (the next daemon adopts it)."""
        ...

    def trim_console(self, limit: int) -> None:
        """Keeps what the guest wrote to its console under `limit` bytes on the host."""
        ...


class Driver(Protocol):
    """Makes, adopts, snapshots and removes VMs under one data directory."""

    paths: Paths

    @property
    def accel(self) -> AccelChoice: ...

    @property
    def kernel(self) -> Kernel:
        """The kernel new VMs boot."""
        ...

    async def prepare(self) -> AccelChoice: ...

    async def refresh_boot(self) -> bool:
        """Moves new VMs onto a better kernel if one appeared; whether it did."""
        ...

    def template_disk_mib(self, template: str) -> int:
        """The size of a template's disk; `NotFound` for an unknown template."""
        ...

    def warm_key(self, template: str, vcpus: int, memory_mib: int) -> str:
        """Names everything a template's warm snapshot depends on (base, kernel, shape)."""
        ...

    async def start(
        self,
        directory: Path,
        *,
        vcpus: int,
        memory_mib: int,
        boot_timeout: float = 60.0,
        disk: str = ...,
    ) -> VM: ...

    async def restore(
        self,
        snap: SnapshotDir,
        directory: Path,
        timeout: float = 30.0,
        spare: VM | None = None,
    ) -> VM:
        """A VM from `snap` in `directory`; with `spare` (from `prespawn(snap, directory)`)
        only the state is left to load."""
        ...

    async def boot_snapshot(
        self,
        snap: SnapshotDir,
        directory: Path,
        *,
        vcpus: int,
        memory_mib: int,
        boot_timeout: float = 60.0,
    ) -> VM:
        """A VM booted from `snap`'s disk alone (its memory, if any, left out)."""
        ...

    async def prespawn(self, snap: SnapshotDir, directory: Path) -> VM:
        """A VM process started ahead for a later `restore(snap, directory, spare=...)`:
        everything but the state (a pool of these makes restores shorter)."""
        ...

    async def adopt(self, directory: Path, pid: int, paused: bool = False) -> VM: ...

    async def snapshot_template(
        self,
        template: str,
        dest: SnapshotDir,
        *,
        vcpus: int,
        memory_mib: int,
        boot_timeout: float = 60.0,
    ) -> dict[str, Any]: ...

    async def snapshot_vm(
        self,
        vm: VM,
        dest: SnapshotDir,
        *,
        memory: bool = True,
        leave_paused: bool = False,
        **meta: Any,
    ) -> tuple[dict[str, Any], float]:
        """The VM's disk and memory (`memory=False`: its disk alone) in `dest`; returns the
        manifest and how long the VM was paused (`leave_paused`, with memory: it stays
        paused after, as it was at the snapshot's instant)."""
        ...

    async def snapshot_stopped(
        self, directory: Path, dest: SnapshotDir, *, vcpus: int, memory_mib: int, **meta: Any
    ) -> dict[str, Any]:
        """A stopped VM's disk (the overlay in `directory`, no process holds it) as a
        snapshot without memory in `dest`; returns the manifest."""
        ...

    async def overlay_from(self, snap: SnapshotDir, directory: Path) -> None:
        """A new VM directory holding an overlay on the snapshot's disk (checked first),
        booted later by `start`: a stopped sandbox made from a disk snapshot."""
        ...

    async def flatten(self, snap: SnapshotDir) -> dict[str, Any]:
        """A layered snapshot (`SnapshotDir.is_layered`) made whole; others as they are."""
        ...

    def stray_pids(self, keep: set[int], directory: Path | None = None) -> list[int]:
        """VM processes of this data directory (or of one VM directory) nobody owns."""
        ...

    async def kill_pid(self, pid: int, directory: Path | None = None) -> None:
        """Kills a VM process left behind; with `directory`, only if it runs that VM."""
        ...

    def cpu_seconds(self, vm: VM) -> float | None: ...

    def host_memory_mib(self, vm: VM) -> float | None:
        """The VM's proportional share of host memory (PSS)."""
        ...

    def disk_bytes(self, directory: Path) -> int:
        """Host disk a VM directory's disks take (allocated blocks, not their size)."""
        ...

    async def destroy(self, vm: VM) -> None: ...

    def remove_directory(self, directory: Path) -> None: ...

    def clear_sockets(self, directory: Path) -> None: ...
