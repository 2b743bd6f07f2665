"""One QEMU microVM process: start, wait for its agent, stop cleanly or kill hard."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import hashlib
import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qemu.qmp import EventListener, QMPClient

from cella import errors
from cella.guest.client import AgentClient
from cella.runtime.qemu.args import VMConfig, host_tsc_khz, qemu_argv

if TYPE_CHECKING:
    from cella.runtime.qemu.jail import Jail

_PR_SET_PDEATHSIG = 1
_PR_SET_THP_DISABLE = 41
_thp_off = False


def no_thp_inherited() -> None:
    """No transparent huge pages for this process's children, QEMU above all: restored VMs
    share their RAM file page by page, and huge pages would turn small private writes into
    2 MiB copies (and the TCG code cache into 2 MiB chunks). The flag is set on the calling
    process (the daemon, whose own heap gains nothing from huge pages) once: children
    inherit it and keep it across exec, so QEMU starts without a hook run between fork and
    exec, which would make every start a full fork of the daemon (page tables and all,
    ~20-45 ms with the event loop waiting) instead of a vfork (~1 ms)."""
    global _thp_off
    if not _thp_off:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_THP_DISABLE, 1, 0, 0, 0)
        _thp_off = True


def _die_with_parent() -> None:
    """Runs in the child before exec (an unjailed QEMU only: the jailer sets the signal
    itself, after its uid change): QEMU gets SIGKILL when its parent goes away."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class QemuVM:
    """A running microVM with its QMP monitor and guest-agent channel."""

    def __init__(
        self, config: VMConfig, *, die_with_parent: bool = True, jail: Jail | None = None
    ) -> None:
        self.config = config
        self.die_with_parent = die_with_parent
        self.jail = jail
        self.process: asyncio.subprocess.Process | None = None
        self._adopted_pid: int | None = None  # a QEMU started by an earlier daemon
        self.qmp: QMPClient | None = None
        self._agent: AgentClient | None = None
        self.boot_seconds: float | None = None
        self.restore_spans: dict[str, float] = {}  # seconds by step of its restore
        self._cpu_marked = 0.0  # QEMU's CPU seconds at the last restore step
        self._migration_events = False  # QEMU announces migration changes (see below)
        self.directory: Path | None = None
        self.exit_hooks: list[Callable[[], None]] = []
        self.accel_reason = ""
        self.spare_of: Path | None = None  # the snapshot a spare QEMU waits to load

    @property
    def accel(self) -> str:
        return self.config.accel

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def vcpus(self) -> int:
        return self.config.vcpus

    @property
    def memory_mib(self) -> int:
        return self.config.memory_mib

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else self._adopted_pid

    @property
    def agent(self) -> AgentClient:
        if self._agent is None:
            raise errors.AgentUnavailable("the VM is not running")
        return self._agent

    @property
    def running(self) -> bool:
        if self.process is not None:
            return self.process.returncode is None
        return self._adopted_pid is not None and pid_alive(self._adopted_pid)

    @property
    def usable(self) -> bool:
        return self.running and self._agent is not None and not self._agent.closed

    async def exit_reason(self) -> str:
        if self.process is None:
            return "QEMU ended" + self._console_hint()
        return await self._exit_reason()

    async def detach(self) -> None:
        await self._close_channels()

    @classmethod
    async def adopt(
        cls, config: VMConfig, pid: int, timeout: float = 5.0, paused: bool = False
    ) -> QemuVM:
        """Reconnects to a VM that outlived the process that started it."""
        vm = cls(config, die_with_parent=False)
        vm._adopted_pid = pid
        if not pid_alive(pid):
            raise errors.SandboxCrashed(f"QEMU process {pid} is gone")
        try:
            vm.qmp = QMPClient(config.name)
            await asyncio.wait_for(vm.qmp.connect(str(config.qmp_socket)), timeout)
            vm._agent = await AgentClient.connect(config.agent_socket, on_lost=vm._lost_reason)
            status: Any = await vm.qmp.execute("query-status")
            if paused:  # frozen vCPUs cannot answer a ping; QEMU's word is enough
                if status.get("status") != "paused":
                    raise errors.SandboxCrashed(f"expected a paused VM, found {status}")
            else:
                if status.get("status") != "running":
                    # left paused by an interrupted snapshot (its RAM copy to a helper that
                    # died with the daemon): cancel that and let it run on
                    with contextlib.suppress(Exception):
                        await vm.qmp.execute("migrate_cancel")
                    await vm.qmp.execute("cont")
                await vm._agent.ping(timeout=timeout)
        except BaseException:
            await vm._close_channels()
            raise
        return vm

    async def start(self, boot_timeout: float = 60.0) -> None:
        started = time.perf_counter()
        self.config.console_log.write_bytes(b"")
        await self._spawn()
        try:
            await asyncio.wait_for(self._connect(), boot_timeout)
        except TimeoutError:
            await self.kill()
            raise errors.AgentUnavailable(
                f"the guest agent was not ready within {boot_timeout:.0f} s{self._console_hint()}"
            ) from None
        except BaseException:
            await self.kill()
            raise
        self.boot_seconds = time.perf_counter() - started

    async def _spawn(self) -> None:
        cfg = self.config
        for sock in (cfg.qmp_socket, cfg.agent_socket):
            sock.unlink(missing_ok=True)
        cfg.console_log.touch()
        argv = qemu_argv(cfg, host_tsc_khz())
        no_thp_inherited()
        prepare = _die_with_parent if self.die_with_parent else None
        if self.jail is not None:
            jail = self.jail
            argv = jail.wrap(cfg, argv, self.die_with_parent)
            prepare = None  # the jailer sets the parent-death signal after its uid change
            self.exit_hooks.append(lambda: jail.release(cfg.name))
        self.process = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            preexec_fn=prepare,
            start_new_session=True,
        )

    async def spawn_listening(self, incoming_socket: Path) -> None:
        """Starts a QEMU that waits on a socket for a VM to migrate into it.

        Its agent socket is connected too, like the source's: the guest's idea of whether
        its host end is connected travels in the saved state, and a guest restored believing
        it is not would block writing to the port.
        """
        await self._spawn()
        cfg = self.config
        while not (
            cfg.qmp_socket.exists() and cfg.agent_socket.exists() and incoming_socket.exists()
        ):
            await self._check_alive()
            await asyncio.sleep(0.001)
        self.qmp = QMPClient(cfg.name)
        await self.qmp.connect(str(cfg.qmp_socket))
        self._agent = await AgentClient.connect(cfg.agent_socket, on_lost=self._lost_reason)

    async def wait_incoming(self) -> None:
        await self._wait_migration()

    async def restore(
        self,
        state: Path,
        timeout: float = 30.0,
        prefill: Callable[[int], None] | None = None,
    ) -> None:
        """Starts from a saved device state instead of booting (config.incoming == "defer").

        `prefill(pid)` runs once QEMU has mapped the guest's RAM and before the state is
        loaded (it writes a RAM layer). The agent channel is connected before the vCPUs
        run, so the guest never sees its host end go away.
        """
        started = time.perf_counter()
        try:
            async with asyncio.timeout(timeout):
                await self.await_incoming()
        except TimeoutError:
            await self.kill()
            raise errors.AgentUnavailable(f"QEMU was not up within {timeout:.0f} s") from None
        self.restore_spans["qemu_start"] = time.perf_counter() - started
        self._cpu_span("cpu_qemu_start")
        left = max(0.0, timeout - (time.perf_counter() - started))  # one budget for both
        await self.load(state, left, prefill)
        self.boot_seconds = time.perf_counter() - started

    async def await_incoming(self) -> None:
        """Spawns QEMU waiting for its state (config.incoming == "defer"), connected: the
        part of a restore that does not depend on the state, done ahead by a spare."""
        await self._spawn()
        try:
            cfg = self.config
            while not (cfg.qmp_socket.exists() and cfg.agent_socket.exists()):
                await self._check_alive()
                await asyncio.sleep(0.001)
            self.qmp = QMPClient(cfg.name)
            # QEMU answers QMP from its main loop, after the machine (and its RAM) exists
            await self.qmp.connect(str(cfg.qmp_socket))
            self._agent = await AgentClient.connect(cfg.agent_socket, on_lost=self._lost_reason)
            await self._set_ignore_shared(True)  # how the state will come: set ahead too
        except BaseException:
            await self.kill()
            raise

    async def load(
        self,
        state: Path,
        timeout: float = 30.0,
        prefill: Callable[[int], None] | None = None,
    ) -> None:
        """Loads the state into a QEMU waiting for it (`await_incoming`) and runs it."""
        started = time.perf_counter()
        try:
            await asyncio.wait_for(self._load(state, prefill), timeout)
        except TimeoutError:
            await self.kill()
            raise errors.AgentUnavailable(
                f"restore did not finish within {timeout:.0f} s"
            ) from None
        except BaseException:
            await self.kill()
            raise
        self.boot_seconds = time.perf_counter() - started

    async def _load(self, state: Path, prefill: Callable[[int], None] | None) -> None:
        assert self.qmp is not None and self._agent is not None
        started = time.perf_counter()
        if prefill is not None:
            assert self.pid is not None
            await asyncio.to_thread(prefill, self.pid)
        await self._hand_file("state", state, os.O_RDONLY)
        await self.qmp.execute("migrate-incoming", {"uri": "fd:state"})
        await self._wait_migration()
        await self.qmp.execute("cont")
        loaded = time.perf_counter()
        self._cpu_span("cpu_state_load")
        try:
            await self._agent.ping(timeout=30.0)
        except errors.Timeout:
            raise errors.AgentUnavailable(
                f"the restored guest's agent did not answer{self._console_hint()}"
            ) from None
        # the guest's first answer: on a new QEMU's empty translation cache under TCG
        self.restore_spans.update(
            state_load=loaded - started, first_answer=time.perf_counter() - loaded
        )
        self._cpu_span("cpu_first_answer")

    def _cpu_span(self, step: str) -> None:
        """QEMU's CPU time (all its threads) spent since the last mark: under TCG most of
        a restore's cost is the guest's CPU, which the wall-clock spans do not show."""
        if self.pid is None:
            return
        now = threads_cpu_seconds(self.pid)
        self.restore_spans[step] = max(0.0, now - self._cpu_marked)
        self._cpu_marked = now

    def mark_cpu(self) -> None:
        """Starts the next CPU span here (a spare's start was paid ahead)."""
        if self.pid is not None:
            self._cpu_marked = threads_cpu_seconds(self.pid)

    async def _set_ignore_shared(self, on: bool) -> None:
        assert self.qmp is not None
        # `events`: QEMU announces each change of the migration's status (MIGRATION), which
        # wakes `_await_migration` instead of a query every few milliseconds
        capabilities = {"x-ignore-shared": on, "events": True}
        await self.qmp.execute(
            "migrate-set-capabilities",
            {"capabilities": [{"capability": k, "state": v} for k, v in capabilities.items()]},
        )
        self._migration_events = True
        # QEMU throttles migration to 128 MiB/s by default: a local copy needs no throttle
        await self.qmp.execute("migrate-set-parameters", {"max-bandwidth": UNTHROTTLED})

    async def _wait_migration(self) -> None:
        """Waits for an incoming migration into this (fresh) QEMU to finish."""

        def ended(status: str | None, desc: str) -> bool:
            if status in ("failed", "cancelled"):
                raise errors.CellaError(f"migration {status}: {desc}")
            return status == "completed"

        await self._await_migration(ended)

    async def _await_migration(self, ended: Callable[[str | None, str], bool]) -> None:
        """Asks QEMU for the migration's status until `ended(status, error)` says so (or
        raises), again on each of its MIGRATION events, and every few milliseconds where
        they were not asked for (a VM that came without `_set_ignore_shared`)."""
        assert self.qmp is not None
        every = MIGRATION_RECHECK if self._migration_events else MIGRATION_POLL
        changes = EventListener("MIGRATION")
        with self.qmp.listen(changes):
            while not ended(*await self._migration_status()):
                if self.process is not None and self.process.returncode is not None:
                    raise errors.SandboxCrashed(f"QEMU exited: {await self._exit_reason()}")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changes.get(), every)

    async def _migration_status(self) -> tuple[str | None, str]:
        assert self.qmp is not None
        info: Any = await self.qmp.execute("query-migrate")
        if not isinstance(info, dict):
            return None, ""
        return info.get("status"), str(info.get("error-desc", ""))

    async def _migrate(self, uri: str) -> None:
        """Starts a migration and waits for it.

        A socket migration connects asynchronously, so until it does, QEMU still reports the
        previous migration's outcome: an earlier failure (say, of a snapshot interrupted by
        a daemon crash) is not taken for this one's.
        """
        assert self.qmp is not None
        previous = await self._migration_status()
        await self.qmp.execute("migrate", {"uri": uri})
        stale_until = asyncio.get_running_loop().time() + 10.0

        def ended(status: str | None, desc: str) -> bool:
            nonlocal previous
            if status in ("failed", "cancelled"):
                stale = (status, desc) == previous
                if not stale or asyncio.get_running_loop().time() > stale_until:
                    raise errors.CellaError(f"migration {status}: {desc}")
            elif status != "completed":
                previous = (None, "")  # this migration has started: its end is its own
            return status == "completed"

        await self._await_migration(ended)

    async def save_state(self, dest: Path, *, ignore_shared: bool) -> None:
        """Writes the device state (and RAM unless it is shared) to `dest`.

        The VM is left stopped; `resume()` lets it run on.
        """
        assert self.qmp is not None
        await self._set_ignore_shared(ignore_shared)
        await self._hand_file("state", dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        await self._migrate("fd:state")

    async def save_devices(self, dest: Path) -> None:
        """Writes the device state alone (no RAM) of a stopped VM to `dest`.

        QEMU's `xen-save-devices-state` does exactly that (it is not Xen-specific); a VM
        restores from it with `VMConfig.devices_only` and its RAM from elsewhere.
        """
        assert self.qmp is not None
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            self.qmp.send_fd_scm(fd)
            added: Any = await self.qmp.execute("add-fd", {})
        finally:
            os.close(fd)
        fdset = added["fdset-id"]
        try:
            await self.qmp.execute(
                "xen-save-devices-state", {"filename": f"/dev/fdset/{fdset}", "live": False}
            )
        finally:
            await self.qmp.execute("remove-fd", {"fdset-id": fdset})

    async def _hand_file(self, name: str, path: Path, flags: int) -> None:
        """Opens `path` here and hands QEMU the descriptor as `name` (QMP `getfd`): QEMU
        needs neither the right to open it nor a helper process (its seccomp filter forbids
        spawning one)."""
        fd = os.open(path, flags | os.O_CLOEXEC, 0o600)
        try:
            await self._hand_fd(name, fd)
        finally:
            os.close(fd)

    async def _hand_fd(self, name: str, fd: int) -> None:
        assert self.qmp is not None
        self.qmp.send_fd_scm(fd)
        await self.qmp.execute("getfd", {"fdname": name})

    async def migrate_to(self, socket_path: Path) -> None:
        """Sends the whole VM (RAM included) to a QEMU waiting with `-incoming unix:PATH`;
        the VM is left stopped (`resume()` lets it run on). Callers pause it first: see
        `snapshot_running` for why. The daemon connects and hands QEMU the socket: a jailed
        QEMU cannot see the other's socket path."""
        assert self.qmp is not None
        await self._set_ignore_shared(False)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(str(socket_path))
            await self._hand_fd("migration", conn.fileno())
        await self._migrate("fd:migration")

    async def split_disk(self, top: Path) -> None:
        """Puts a new, empty overlay (`top`, in the VM's directory, made by QEMU) over the
        disk the guest writes. QEMU flushes the disk first and writes only `top` from then
        on: the file below keeps what the guest wrote so far, unchanged, so it can be
        copied while the guest runs. `merge_disk` undoes it."""
        assert self.qmp is not None and self.config.disk is not None
        await self.qmp.execute(
            "blockdev-snapshot-sync",
            {
                "device": "root",
                "snapshot-file": str(top),
                "format": "qcow2",
                "mode": "absolute-paths",
            },
        )
        self.config = dataclasses.replace(self.config, disk=top)

    async def merge_disk(self, base: Path) -> None:
        """Writes the overlay the guest writes back into `base`, the file below it, and
        makes `base` the disk the guest writes again (QEMU's active commit, running or
        paused). The overlay's file is left for the caller to remove."""
        assert self.qmp is not None
        nodes: Any = await self.qmp.execute("query-named-block-nodes", {"flat": True})
        found = [  # its qcow2 node (the file node below it has the same name)
            n["node-name"] for n in nodes if n.get("file") == str(base) and n.get("drv") == "qcow2"
        ]
        if not found:
            raise errors.CellaError(f"QEMU has no disk {base} below the overlay")
        await self.qmp.execute(
            "block-commit",
            {"job-id": MERGE_JOB, "device": "root", "base-node": found[0], "auto-dismiss": False},
        )
        while True:
            jobs: Any = await self.qmp.execute("query-jobs")
            job = next((j for j in jobs if j.get("id") == MERGE_JOB), None)
            if job is None:
                raise errors.CellaError("the disk merge vanished")
            if job["status"] == "ready":
                await self.qmp.execute("job-complete", {"id": MERGE_JOB})
            elif job["status"] == "concluded":
                await self.qmp.execute("job-dismiss", {"id": MERGE_JOB})
                if job.get("error"):
                    raise errors.CellaError(f"merging the disk overlay failed: {job['error']}")
                break
            await asyncio.sleep(0.01)
        self.config = dataclasses.replace(self.config, disk=base)

    async def grow_disk(self, size_mib: int) -> None:
        """Enlarges the root disk (the guest is told at once) and its ext4 file system."""
        assert self.qmp is not None
        await self.qmp.execute("block_resize", {"device": "root", "size": size_mib << 20})
        result = await self.agent.exec(["resize2fs", "/dev/vda"], timeout=300)
        if result.exit_code != 0:
            raise errors.GuestError(
                f"resize2fs failed: {result.stderr.decode(errors='replace')[-500:]}"
            )

    async def pause(self) -> None:
        """Freezes the vCPUs: processes keep their memory and go on after `resume()`."""
        assert self.qmp is not None
        await self.qmp.execute("stop")

    async def resume(self) -> None:
        assert self.qmp is not None
        await self.qmp.execute("cont")

    async def _connect(self) -> None:
        cfg = self.config
        while not (cfg.qmp_socket.exists() and cfg.agent_socket.exists()):
            await self._check_alive()
            await asyncio.sleep(0.002)
        self.qmp = QMPClient(cfg.name)
        await self.qmp.connect(str(cfg.qmp_socket))
        self._agent = await AgentClient.connect(cfg.agent_socket, on_lost=self._lost_reason)
        ping = asyncio.ensure_future(self._agent.ping(timeout=None))
        while not ping.done():
            done, _ = await asyncio.wait({ping}, timeout=0.05)
            if not done:
                await self._check_alive()
        ping.result()

    async def _check_alive(self) -> None:
        assert self.process is not None
        if self.process.returncode is not None:
            raise errors.AgentUnavailable(f"QEMU exited during boot: {await self._exit_reason()}")

    async def _exit_reason(self) -> str:
        assert self.process is not None
        stderr = b""
        if self.process.stderr is not None:
            with contextlib.suppress(Exception):
                stderr = await asyncio.wait_for(self.process.stderr.read(4096), 1.0)
        text = stderr.decode(errors="replace").strip()
        return (text or f"exit status {self.process.returncode}") + self._console_hint()

    def _console_hint(self) -> str:
        tail = self.console_tail(800).strip()
        return f"\n--- guest console ---\n{tail}" if tail else ""

    async def _lost_reason(self) -> str:
        """Why the agent channel closed: a guest panic, QEMU killed, or a poweroff."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.wait(), 2.0)
        console = self.console_tail(4000)
        if "Kernel panic" in console:
            line = next((ln for ln in console.splitlines() if "Kernel panic" in ln), "Kernel panic")
            return f"the guest kernel panicked: {line.strip()}"
        if self.process is not None and self.process.returncode is not None:
            rc = self.process.returncode
            how = f"killed by signal {-rc}" if rc < 0 else f"exited with status {rc}"
            return f"the VM stopped (QEMU {how})"
        if not self.running:
            return "the VM stopped"
        return "the VM closed its agent channel"

    def console_tail(self, limit: int = 4000) -> str:
        """The last `limit` bytes the guest wrote to its console (across a trim)."""
        data = b""
        for path in (self.config.console_log, _rotated(self.config.console_log)):
            try:
                with path.open("rb") as f:
                    f.seek(0, os.SEEK_END)
                    f.seek(max(0, f.tell() - (limit - len(data))))
                    data = f.read() + data
            except OSError:
                continue
            if len(data) >= limit:
                break
        return data.decode(errors="replace")

    def trim_console(self, limit: int) -> None:
        """Keeps the console log under `limit` bytes: past it, its last half moves to
        `console.log.1` and the log starts over (QEMU appends, so it writes on at the new
        end). A guest writing to its console cannot fill the host's disk."""
        log = self.config.console_log
        try:
            size = log.stat().st_size
            if size <= limit:
                return
            with log.open("rb") as f:
                f.seek(size - limit // 2)
                _rotated(log).write_bytes(f.read(limit // 2))
            os.truncate(log, 0)
        except OSError:
            return

    async def stop(self, timeout: float = 15.0) -> None:
        """Clean shutdown: the guest syncs its disks and powers off; force if it will not."""
        if self.running and self._agent is not None and not self._agent.closed:
            with contextlib.suppress(errors.CellaError, OSError):
                await self._agent.shutdown(timeout=timeout)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wait(), timeout)
        if self.running and self.qmp is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.qmp.execute("quit"), 5.0)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wait(), 5.0)
        await self.kill()

    async def kill(self) -> None:
        """Hard stop: SIGKILL QEMU and release every socket."""
        if self.process is not None and self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
            await self.process.wait()
        elif self._adopted_pid is not None and pid_alive(self._adopted_pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._adopted_pid, signal.SIGKILL)
            await self.wait()
        await self._close_channels()
        for sock in (self.config.qmp_socket, self.config.agent_socket):
            sock.unlink(missing_ok=True)
        for hook in self.exit_hooks:
            hook()
        with contextlib.suppress(OSError):  # shared with an incoming-migration socket
            self.config.qmp_socket.parent.rmdir()

    async def _close_channels(self) -> None:
        if self._agent is not None:
            await self._agent.close()
        if self.qmp is not None:
            with contextlib.suppress(Exception):
                await self.qmp.disconnect()
            self.qmp = None

    async def wait(self) -> int:
        """Waits for QEMU to end; an adopted one (not our child) is polled."""
        if self.process is not None:
            return await self.process.wait()
        while self._adopted_pid is not None and pid_alive(self._adopted_pid):
            await asyncio.sleep(0.02)
        return 0


UNTHROTTLED = 1 << 40  # bytes per second
MIGRATION_POLL = 0.002  # seconds between status queries of a migration QEMU does not announce
MIGRATION_RECHECK = 0.05  # and of one it announces (its events wake the wait at once)
MERGE_JOB = "cella-merge"


def _rotated(log: Path) -> Path:
    return log.with_name(log.name + ".1")


def pid_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def qemu_cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


@dataclass(frozen=True, slots=True)
class VMFiles:
    """The per-VM files QEMU creates, kept together in the VM's directory."""

    qmp_socket: Path
    agent_socket: Path
    console_log: Path

    @classmethod
    def under(cls, directory: Path) -> VMFiles:
        sockets = socket_dir(directory)
        return cls(sockets / "qmp", sockets / "agent", directory / "console.log")


SOCKET_ROOT = Path("/run/cella")


def socket_dir(directory: Path) -> Path:
    """A short directory for a VM's unix sockets (their paths must stay under 108 bytes,
    whatever the data directory), derived from the VM's directory so a restarted daemon
    finds them again."""
    digest = hashlib.sha256(str(directory.resolve()).encode()).hexdigest()[:20]
    path = SOCKET_ROOT / digest
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


def threads_schedstat(pid: int) -> tuple[float, int]:
    """CPU seconds and times scheduled in (wake-ups) of a process's live threads, from their
    schedstat (nanoseconds, where /proc/PID/stat counts clock ticks of 10 ms)."""
    cpu_ns = wakeups = 0
    with contextlib.suppress(OSError):
        for task in os.scandir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                fields = Path(task.path, "schedstat").read_text().split()
                cpu_ns, wakeups = cpu_ns + int(fields[0]), wakeups + int(fields[2])
    return cpu_ns / 1e9, wakeups


def threads_cpu_seconds(pid: int) -> float:
    """CPU seconds of a process's live threads (`threads_schedstat`)."""
    return threads_schedstat(pid)[0]
