"""Processes: commands that outlive the connection that started them.

A process has an id chosen by its caller (starting it again with the same id attaches to
it: a retried start never runs a command twice). Its output is kept per stream in a bounded
buffer with byte offsets, so clients attach, leave and re-attach from where they were; while
it runs it takes stdin, signals and terminal sizes. Without a client attached for its idle
timeout it is killed, and with `kill_on_disconnect` it is killed as soon as the last one
leaves; once ended it stays readable for its `ttl` (at most the operator's `keep_seconds`).
Each one is an exec of the sandbox (traced, counted as activity) run by the `exec` room.

What the daemon keeps is bounded per sandbox and per tenant (`ProcessLimits`): a start over
the count evicts the longest-ended processes, or is refused when all of them still run; kept
output over the bytes drops the oldest bytes of ended processes first (longest-ended first),
then those of the process that is writing.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from dataclasses import dataclass, field

from cella import errors
from cella.config import DaemonSettings
from cella.guest.client import ExecControl, Output, Started
from cella.guest.protocol import ExitStatus
from cella.models import ExecRequest, ProcessInfo, ProcessSummary
from cella.policy.access import Permission, Principal
from cella.service.exec import Exec

log = logging.getLogger("cella.processes")
STREAMS = ("stdout", "stderr")
BUFFER = 4 << 20  # output kept per stream for re-attaching clients
SWEEP_SECONDS = 1.0
Scope = tuple[str, str]  # ("sandbox", id) or ("tenant", name): what limits count over
ENTRYPOINT = "entrypoint"  # the id of an image's Entrypoint/Cmd started at create
VIEW, EXEC = Permission.view, Permission.exec  # look at a process (output too); drive one


@dataclass(frozen=True, slots=True)
class ProcessSpec:
    request: ExecRequest  # command, cwd, env, user; its timeout is the wall-clock deadline
    pty: tuple[int, int] | None = None  # (columns, rows): run in a terminal
    stdin: bool = False  # keep stdin open for `write`
    idle_timeout: float | None = None  # killed after this long with no client attached
    kill_on_disconnect: bool = False  # killed when the last client leaves
    ttl: float | None = 600.0  # kept this long after it ends (None: as long as allowed)


@dataclass(frozen=True, slots=True)
class ProcessLimits:
    """What the daemon keeps of processes: counts (running or ended) and output bytes, per
    sandbox and per tenant, and how long an ended one is kept at most."""

    per_sandbox: int = 64
    per_tenant: int = 512
    sandbox_bytes: int = 64 << 20
    tenant_bytes: int = 256 << 20
    keep_seconds: float = 86400.0

    @classmethod
    def of(cls, settings: DaemonSettings) -> ProcessLimits:
        return cls(
            per_sandbox=settings.max_processes_per_sandbox,
            per_tenant=settings.max_processes_per_tenant,
            sandbox_bytes=settings.max_process_output_mib_per_sandbox << 20,
            tenant_bytes=settings.max_process_output_mib_per_tenant << 20,
            keep_seconds=settings.max_process_keep_seconds,
        )


class OutputBuffer:
    """The latest `cap` bytes of one stream, addressed by absolute byte offset."""

    def __init__(self, cap: int = BUFFER) -> None:
        self.cap = cap
        self.start = 0  # offset of data[0]
        self.data = bytearray()

    @property
    def end(self) -> int:
        return self.start + len(self.data)

    def append(self, chunk: bytes) -> int:
        """Keeps `chunk` (and the latest `cap` bytes); returns how many more bytes are kept."""
        before = len(self.data)
        self.data += chunk
        self.drop(len(self.data) - self.cap)
        return len(self.data) - before

    def drop(self, count: int) -> int:
        """Forgets the oldest `count` bytes (offsets stay as they were); returns how many."""
        count = min(max(count, 0), len(self.data))
        del self.data[:count]
        self.start += count
        return count

    def since(self, offset: int) -> tuple[int, bytes]:
        """What is kept from `offset` on; an offset older than what is kept reads from the
        oldest byte still there."""
        offset = min(max(offset, self.start), self.end)
        return offset, bytes(self.data[offset - self.start :])


@dataclass(frozen=True, slots=True)
class Chunk:
    stream: str
    offset: int
    data: bytes


@dataclass(eq=False)
class Process:
    id: str
    who: Principal  # who started it: its command runs as they may
    sandbox_id: str
    spec: ProcessSpec
    pid: int | None = None
    status: ExitStatus | None = None
    failure: errors.CellaError | None = None  # the VM or the agent went away under it
    ended_at: float | None = None
    clients: int = 0
    idle_since: float = field(default_factory=time.monotonic)
    buffers: dict[str, OutputBuffer] = field(
        default_factory=lambda: {s: OutputBuffer() for s in STREAMS}
    )
    control: ExecControl = field(default_factory=ExecControl)
    stdin: asyncio.Queue[bytes | None] = field(default_factory=asyncio.Queue)
    started: asyncio.Event = field(default_factory=asyncio.Event)
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    task: asyncio.Task[None] | None = None

    def summary(self) -> ProcessSummary:
        """Its state and how much output is kept, without the output (for listings)."""
        status = self.status
        return ProcessSummary(
            id=self.id,
            command=self.spec.request.command,
            running=not self.done,
            exit_code=status.exit_code if status else None,
            signal=status.signal if status else None,
            stdout_bytes=len(self.buffers["stdout"].data),
            stderr_bytes=len(self.buffers["stderr"].data),
        )

    def info(self) -> ProcessInfo:
        """Its state and the output kept of it."""
        return ProcessInfo(
            **self.summary().model_dump(),
            stdout=self.buffers["stdout"].data.decode(errors="replace"),
            stderr=self.buffers["stderr"].data.decode(errors="replace"),
        )

    @property
    def kept(self) -> int:
        """Output bytes kept of it."""
        return sum(len(b.data) for b in self.buffers.values())

    @property
    def done(self) -> bool:
        return self.status is not None or self.failure is not None

    async def write(self, data: bytes) -> None:
        if self.done or not self.spec.stdin:
            raise errors.InvalidState(f"process {self.id} takes no input")
        await self.stdin.put(data)

    async def close_stdin(self) -> None:
        if not self.done and self.spec.stdin:
            await self.stdin.put(None)

    async def kill(self, signal: int = 9) -> None:
        if not self.done:
            await self.control.kill(signal)

    async def resize(self, cols: int, rows: int) -> None:
        if not self.done:
            await self.control.resize(cols, rows)

    async def follow(self, offsets: dict[str, int] | None = None) -> AsyncIterator[Chunk]:
        """Output from `offsets` (per stream; 0 by default) as it comes, until the process
        ends; then the caller reads `status` or `failure`."""
        at = {s: (offsets or {}).get(s, 0) for s in STREAMS}
        while True:
            async with self.changed:
                pending = [(s, *self.buffers[s].since(at[s])) for s in STREAMS]
                pending = [p for p in pending if p[2]]
                if not pending and not self.done:
                    await self.changed.wait()
                    continue
            for stream, offset, data in pending:
                at[stream] = offset + len(data)
                yield Chunk(stream, offset, data)
            if not pending and self.done:
                return

    @contextlib.asynccontextmanager
    async def attached(self) -> AsyncIterator[Process]:
        """A client follows the process for the duration of the block."""
        self.clients += 1
        try:
            yield self
        finally:
            self.clients -= 1
            self.idle_since = time.monotonic()
            if self.clients == 0 and self.spec.kill_on_disconnect and not self.done:
                await self.kill()

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()


class Processes:
    def __init__(self, exec_room: Exec, limits: ProcessLimits | None = None) -> None:
        self.exec = exec_room
        self.registry = exec_room.registry
        self.limits = limits or ProcessLimits()
        self._procs: dict[tuple[str, str], Process] = {}
        self._kept: Counter[Scope] = Counter()  # output bytes kept per scope
        self._sweeper: asyncio.Task[None] | None = None

    def start_sweeper(self) -> None:
        self._sweeper = asyncio.create_task(self._sweep(), name="cella-processes")

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        for proc in self._procs.values():
            if proc.task is not None:
                proc.task.cancel()

    async def start(self, who: Principal, sandbox_id: str, pid: str, spec: ProcessSpec) -> Process:
        """Starts the command as process `pid`, or returns the one already started under
        that id (its spec is not compared). Returns once the guest has started it."""
        self.registry.owned(who, sandbox_id, EXEC)
        if (proc := self._procs.get((sandbox_id, pid))) is None:
            self.exec.check(who, sandbox_id)  # unknown or stopped sandboxes fail here
            self._make_room(who.tenant, sandbox_id)
            proc = self._procs[sandbox_id, pid] = Process(pid, who, sandbox_id, spec)
            proc.task = asyncio.create_task(self._run(proc), name=f"process-{pid}")
        await proc.started.wait()  # set when the guest started it, or when it failed
        if not proc.started.is_set() and proc.failure is not None:
            self._remove(proc)
            raise proc.failure
        return proc

    def get(self, who: Principal, sandbox_id: str, pid: str, need: Permission = VIEW) -> Process:
        self.registry.owned(who, sandbox_id, need)
        if (proc := self._procs.get((sandbox_id, pid))) is None:
            raise errors.NotFound(f"no process {pid!r} in {sandbox_id}")
        return proc

    def list(self, who: Principal, sandbox_id: str, need: Permission = VIEW) -> list[Process]:
        self.registry.owned(who, sandbox_id, need)
        return [p for (sid, _), p in self._procs.items() if sid == sandbox_id]

    def kept(self, scope: Scope) -> int:
        """Output bytes kept of the processes of a sandbox (`("sandbox", id)`) or of a
        tenant (`("tenant", name)`)."""
        return self._kept[scope]

    async def _run(self, proc: Process) -> None:
        stdin = _drain(proc.stdin) if proc.spec.stdin else None
        try:
            async for event in self.exec.stream(
                proc.who,
                proc.sandbox_id,
                proc.spec.request,
                stdin=stdin,
                pty=proc.spec.pty,
                control=proc.control,
            ):
                if isinstance(event, Started):
                    proc.pid = event.pid
                    proc.started.set()
                elif isinstance(event, Output):
                    self._keep(proc, event.stream, event.data)
                    await proc._notify()
                elif isinstance(event, ExitStatus):
                    proc.status = event
        except errors.CellaError as exc:
            proc.failure = exc
        except asyncio.CancelledError:
            proc.failure = errors.SandboxCrashed("the daemon is shutting down")
            raise
        finally:
            proc.ended_at = time.monotonic()
            proc.started.set()
            await proc._notify()

    # -- what is kept --------------------------------------------------------------------

    def _make_room(self, tenant: str, sandbox_id: str) -> None:
        """Room for one more process in the sandbox and in the tenant: the longest-ended
        go; refused when those over the limit all still run."""
        evict: builtins.list[Process] = []
        for scope, limit, setting in (
            (("sandbox", sandbox_id), self.limits.per_sandbox, "max_processes_per_sandbox"),
            (("tenant", tenant), self.limits.per_tenant, "max_processes_per_tenant"),
        ):
            kept = [p for p in self._in(scope) if p not in evict]
            over = len(kept) + 1 - limit
            ended = _longest_ended(kept)[: max(over, 0)]
            if len(ended) < over:
                running = sum(1 for p in kept if not p.done)
                raise errors.QuotaExceeded(
                    f"{scope[0]} {scope[1]!r} has {running} running processes and keeps at "
                    f"most {limit} ({setting}): wait for one to end, or kill one"
                )
            evict += ended
        for proc in evict:
            log.info("process %s of %s evicted: room for a new one", proc.id, proc.sandbox_id)
            self._remove(proc)

    def _keep(self, proc: Process, stream: str, data: bytes) -> None:
        """Output of `proc`, kept within its buffer and the sandbox's and tenant's bytes:
        over those, the oldest bytes of ended processes go (longest-ended first), then the
        writer's own oldest."""
        grown = proc.buffers[stream].append(data)
        if self._procs.get((proc.sandbox_id, proc.id)) is not proc:
            return  # forgotten (its sandbox is gone): counted nowhere
        self._count(proc, grown)
        for scope, limit in (
            (("sandbox", proc.sandbox_id), self.limits.sandbox_bytes),
            (("tenant", proc.who.tenant), self.limits.tenant_bytes),
        ):
            over = self._kept[scope] - limit
            if over <= 0:
                continue
            for victim in [*_longest_ended(self._in(scope)), proc]:
                for buffer in victim.buffers.values():
                    dropped = buffer.drop(over)
                    self._count(victim, -dropped)
                    over -= dropped
                if over <= 0:
                    break

    def _in(self, scope: Scope) -> builtins.list[Process]:
        return [p for p in self._procs.values() if scope in _scopes(p)]

    def _count(self, proc: Process, delta: int) -> None:
        for scope in _scopes(proc):
            self._kept[scope] += delta
            if not self._kept[scope]:
                del self._kept[scope]

    def _remove(self, proc: Process) -> None:
        if self._procs.get((proc.sandbox_id, proc.id)) is proc:
            del self._procs[(proc.sandbox_id, proc.id)]
            self._count(proc, -proc.kept)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_SECONDS)
            await self.sweep(time.monotonic())

    async def sweep(self, now: float) -> None:
        """Ended processes past their TTL (at most `keep_seconds`) go; running ones left
        without a client for their idle timeout are killed."""
        for proc in list(self._procs.values()):
            spec = proc.spec
            if proc.done:
                ttl = self.limits.keep_seconds if spec.ttl is None else spec.ttl
                if now - (proc.ended_at or now) > min(ttl, self.limits.keep_seconds):
                    self._remove(proc)
            elif (
                spec.idle_timeout is not None
                and proc.clients == 0
                and now - proc.idle_since > spec.idle_timeout
            ):
                log.info("process %s of %s idle: killed", proc.id, proc.sandbox_id)
                await proc.kill()

    def forget(self, sandbox_id: str) -> None:
        """The sandbox is gone: so are its processes."""
        for proc in [p for p in self._procs.values() if p.sandbox_id == sandbox_id]:
            self._remove(proc)


def _scopes(proc: Process) -> tuple[Scope, Scope]:
    """The counters a process's kept output is in: its sandbox's and its tenant's."""
    return ("sandbox", proc.sandbox_id), ("tenant", proc.who.tenant)


def _longest_ended(procs: Iterable[Process]) -> list[Process]:
    """The ended ones, longest-ended first."""
    return sorted((p for p in procs if p.done), key=lambda p: p.ended_at or 0.0)


async def _drain(queue: asyncio.Queue[bytes | None]) -> AsyncIterable[bytes]:
    while (chunk := await queue.get()) is not None:
        yield chunk
