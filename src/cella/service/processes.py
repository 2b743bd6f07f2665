"""Processes: commands that outlive the connection that started them.

A process has an id chosen by its caller (starting it again with the same id attaches to
it: a retried start never runs a command twice). Its output is kept per stream in a bounded
buffer with byte offsets, so clients attach, leave and re-attach from where they were; while
it runs it takes stdin, signals and terminal sizes. Without a client attached for its idle
timeout it is killed, and with `kill_on_disconnect` it is killed as soon as the last one
leaves; once ended it stays readable for its `ttl`. Each one is an exec of the sandbox
(traced, counted as activity) run by the `exec` room.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass, field

from cella import errors
from cella.guest.client import ExecControl, Output, Started
from cella.guest.protocol import ExitStatus
from cella.models import ExecRequest, ProcessInfo
from cella.service.exec import Exec

log = logging.getLogger("cella.processes")
STREAMS = ("stdout", "stderr")
BUFFER = 4 << 20  # output kept per stream for re-attaching clients
SWEEP_SECONDS = 1.0
ENTRYPOINT = "entrypoint"  # the id of an image's Entrypoint/Cmd started at create


@dataclass(frozen=True, slots=True)
class ProcessSpec:
    request: ExecRequest  # command, cwd, env, user; its timeout is the wall-clock deadline
    pty: tuple[int, int] | None = None  # (columns, rows): run in a terminal
    stdin: bool = False  # keep stdin open for `write`
    idle_timeout: float | None = None  # killed after this long with no client attached
    kill_on_disconnect: bool = False  # killed when the last client leaves
    ttl: float | None = 600.0  # kept this long after it ends (None: while the sandbox is)


class OutputBuffer:
    """The latest `cap` bytes of one stream, addressed by absolute byte offset."""

    def __init__(self, cap: int = BUFFER) -> None:
        self.cap = cap
        self.start = 0  # offset of data[0]
        self.data = bytearray()

    @property
    def end(self) -> int:
        return self.start + len(self.data)

    def append(self, chunk: bytes) -> None:
        self.data += chunk
        over = len(self.data) - self.cap
        if over > 0:
            del self.data[:over]
            self.start += over

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
    tenant: str
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

    def info(self) -> ProcessInfo:
        status = self.status
        return ProcessInfo(
            id=self.id,
            command=self.spec.request.command,
            running=not self.done,
            exit_code=status.exit_code if status else None,
            signal=status.signal if status else None,
            stdout=self.buffers["stdout"].data.decode(errors="replace"),
            stderr=self.buffers["stderr"].data.decode(errors="replace"),
        )

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
    def __init__(self, exec_room: Exec) -> None:
        self.exec = exec_room
        self.registry = exec_room.registry
        self._procs: dict[tuple[str, str], Process] = {}
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

    async def start(self, tenant: str, sandbox_id: str, pid: str, spec: ProcessSpec) -> Process:
        """Starts the command as process `pid`, or returns the one already started under
        that id (its spec is not compared). Returns once the guest has started it."""
        key = (sandbox_id, pid)
        proc = self._procs.get(key)
        if proc is None or proc.tenant != tenant:
            self.exec.check(tenant, sandbox_id)  # unknown or stopped sandboxes fail here
            proc = self._procs[key] = Process(pid, tenant, sandbox_id, spec)
            proc.task = asyncio.create_task(self._run(proc), name=f"process-{pid}")
        await proc.started.wait()  # set when the guest started it, or when it failed
        if not proc.started.is_set() and proc.failure is not None:
            self._procs.pop(key, None)
            raise proc.failure
        return proc

    def get(self, tenant: str, sandbox_id: str, pid: str) -> Process:
        self.registry.owned(tenant, sandbox_id)
        proc = self._procs.get((sandbox_id, pid))
        if proc is None or proc.tenant != tenant:
            raise errors.NotFound(f"no process {pid!r} in {sandbox_id}")
        return proc

    def list(self, tenant: str, sandbox_id: str) -> list[Process]:
        self.registry.owned(tenant, sandbox_id)
        return [p for (sid, _), p in self._procs.items() if sid == sandbox_id]

    async def _run(self, proc: Process) -> None:
        stdin = _drain(proc.stdin) if proc.spec.stdin else None
        try:
            async for event in self.exec.stream(
                proc.tenant,
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
                    proc.buffers[event.stream].append(event.data)
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

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_SECONDS)
            now = time.monotonic()
            for key, proc in list(self._procs.items()):
                spec = proc.spec
                if proc.done:
                    if spec.ttl is not None and now - (proc.ended_at or now) > spec.ttl:
                        self._procs.pop(key, None)
                elif (
                    spec.idle_timeout is not None
                    and proc.clients == 0
                    and now - proc.idle_since > spec.idle_timeout
                ):
                    log.info("process %s of %s idle for %ss: killed", *key[::-1], spec.idle_timeout)
                    await proc.kill()

    def forget(self, sandbox_id: str) -> None:
        """The sandbox is gone: so are its processes."""
        for key in [k for k in self._procs if k[0] == sandbox_id]:
            self._procs.pop(key)


async def _drain(queue: asyncio.Queue[bytes | None]) -> AsyncIterable[bytes]:
    while (chunk := await queue.get()) is not None:
        yield chunk
