"""Host side of the guest-agent channel: one unix socket, many concurrent requests."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Mapping,
    Sequence,
)
from dataclasses import dataclass, field, replace
from typing import Literal

from cella import errors
from cella.guest.protocol import (
    CHUNK,
    MAX_FILE_CHANGES,
    STREAM_BIT,
    WINDOW,
    Entry,
    ExecDenied,
    ExitStatus,
    Field,
    FileChange,
    FrameDecoder,
    Msg,
    Owner,
    ProcRecord,
    ProcSummary,
    ProtocolError,
    decode_entries,
    decode_error,
    decode_exec_denied,
    decode_exit,
    decode_file_changes,
    decode_owner,
    decode_procs,
    fields,
    frame,
)
from cella.models.exec import ExecResult, OutputCollector

_CLOSED = object()
_READ_SIZE = 1 << 20
# How long past its own timeout an exec may run before the host stops waiting for the guest.
_TIMEOUT_GRACE = 5.0


@dataclass(frozen=True, slots=True)
class Started:
    pid: int
    channel: int = 0  # the exec's channel: its process records name it


@dataclass(frozen=True, slots=True)
class Output:
    stream: Literal["stdout", "stderr"]
    data: bytes


ExecEvent = Started | Output | ExitStatus


@dataclass(slots=True)
class _Channel:
    queue: asyncio.Queue[tuple[int, bytes] | object] = field(default_factory=asyncio.Queue)
    pending: int = 0  # output bytes received and not yet acknowledged


# Replies that carry output the guest must hold back until acknowledged.
_FLOWING = frozenset({Msg.STDOUT, Msg.STDERR, Msg.DATA})
StreamHandler = Callable[["GuestStream"], Awaitable[None]]
ProcsHandler = Callable[[list[ProcRecord | ProcSummary]], None]
# OWNER frames held for streams not opened yet (each is followed by its SOPEN at once).
_MAX_PENDING_OWNERS = 64


class ExecControl:
    """Signals and terminal size for an exec while it runs (pass it to `exec_stream`)."""

    def __init__(self) -> None:
        self._target: tuple[AgentClient, int] | None = None

    def _bind(self, client: AgentClient, channel: int | None) -> None:
        self._target = (client, channel) if channel is not None else None

    async def kill(self, signal: int = 9) -> None:
        """Sends `signal` to the command's process group (SIGKILL: its whole tree)."""
        if self._target is not None:
            client, cid = self._target
            await client._send_quiet(cid, Msg.KILL, signal.to_bytes(4, "big"))

    async def resize(self, cols: int, rows: int) -> None:
        """A terminal exec's new size (ignored for one without a terminal)."""
        if self._target is not None:
            client, cid = self._target
            size = cols.to_bytes(4, "big") + rows.to_bytes(4, "big")
            await client._send_quiet(cid, Msg.RESIZE, size)


class GuestStream:
    """A TCP connection carried over the agent channel: one the guest opened to an egress
    port, or one the host opened to a port in the guest (`AgentClient.connect`). Reads and
    writes are flow-controlled by acknowledgements in both directions."""

    def __init__(self, client: AgentClient, channel: int, port: int) -> None:
        self.client = client
        self.channel = channel
        self.port = port
        self.owner: Owner | None = None  # the guest process that opened it, when known
        self.opened: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._incoming: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._unacked_in = 0  # bytes received from the guest, not yet acknowledged
        self._inflight = 0  # bytes sent to the guest, not yet acknowledged
        self._room = asyncio.Event()
        self._room.set()
        self.closed = False

    def _feed(self, data: bytes) -> None:
        if self.closed:
            return
        self._unacked_in += len(data)
        if self._unacked_in > WINDOW:
            raise ProtocolError(f"stream {self.channel:#x}: the guest ignored flow control")
        self._incoming.put_nowait(data)

    def _acked(self, count: int) -> None:
        self._inflight = max(0, self._inflight - count)
        if self._inflight < WINDOW:
            self._room.set()

    def _gone(self) -> None:
        self.closed = True
        self._incoming.put_nowait(None)
        self._room.set()
        if not self.opened.done():
            self.opened.set_exception(ConnectionResetError("the stream closed"))

    async def read(self) -> bytes:
        """The next bytes the guest sent; b"" once it sent no more (or the stream closed)."""
        data = await self._incoming.get()
        if data is None:
            self._incoming.put_nowait(None)
            return b""
        if data:
            self._unacked_in -= len(data)
            await self.client._send_quiet(self.channel, Msg.ACK, len(data).to_bytes(4, "big"))
        return data

    async def write(self, data: bytes) -> None:
        """Sends to the guest, waiting while it has a window's worth not yet taken."""
        for off in range(0, len(data), CHUNK):
            piece = data[off : off + CHUNK]
            while self._inflight >= WINDOW and not self.closed:
                self._room.clear()
                await self._room.wait()
            if self.closed:
                raise ConnectionResetError("the guest closed the stream")
            self._inflight += len(piece)
            await self.client._send_quiet(self.channel, Msg.SDATA, piece)

    async def write_eof(self) -> None:
        if not self.closed:
            await self.client._send_quiet(self.channel, Msg.SDATA, b"")

    async def close(self) -> None:
        if not self.closed:
            self._gone()
            self.client._streams.pop(self.channel, None)
            await self.client._send_quiet(self.channel, Msg.SCLOSE)


class AgentClient:
    """Talks to cella-agent over the VM's virtio-serial port (a unix socket on the host).

    The guest is untrusted: frames are bounded by the decoder and every reply is checked
    against what the request allows. When the connection drops (VM died), every waiter gets
    `SandboxCrashed` instead of hanging.
    """

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        on_lost: Callable[[], Awaitable[str]] | None = None,
    ) -> None:
        self._reader = reader
        self._on_lost = on_lost
        self._writer = writer
        self._channels: dict[int, _Channel] = {}
        self._streams: dict[int, GuestStream] = {}
        self._stream_tasks: set[asyncio.Task[None]] = set()
        self.on_stream: StreamHandler | None = None  # none: the guest's connections fail
        self.on_exec_denied: Callable[[ExecDenied], None] | None = None  # policy refusals
        self.on_procs: ProcsHandler | None = None  # traced execs' processes (none: dropped)
        self._owners: dict[int, Owner] = {}
        self.flow_control = True  # agents before version 2 send output unacknowledged
        self._ids = itertools.count(1)
        self._closed: errors.CellaError | None = None
        self._failed = asyncio.Event()
        self._task = asyncio.create_task(self._pump(), name="cella-agent-reader")

    @classmethod
    async def connect(
        cls,
        path: str | os.PathLike[str],
        on_lost: Callable[[], Awaitable[str]] | None = None,
    ) -> AgentClient:
        """`on_lost` explains a dropped channel (guest panic, QEMU killed) to every waiter."""
        reader, writer = await asyncio.open_unix_connection(os.fspath(path), limit=_READ_SIZE)
        return cls(reader, writer, on_lost)

    @property
    def closed(self) -> bool:
        return self._closed is not None

    @property
    def failure(self) -> errors.CellaError | None:
        """Why the channel closed, once it has."""
        return self._closed

    async def wait_closed(self) -> errors.CellaError:
        await self._failed.wait()
        assert self._closed is not None
        return self._closed

    async def close(self) -> None:
        self._fail(errors.AgentUnavailable("agent connection closed"))
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task
        self._writer.close()
        with contextlib.suppress(Exception):
            await self._writer.wait_closed()

    # -- plumbing -------------------------------------------------------------------------

    async def _pump(self) -> None:
        decoder = FrameDecoder()
        try:
            while True:
                data = await self._reader.read(_READ_SIZE)
                if not data:
                    reason = "the VM closed its agent channel"
                    if self._on_lost is not None:
                        reason = await self._on_lost()
                    raise errors.SandboxCrashed(reason)
                for channel, msg, payload in decoder.feed(data):
                    if channel == 0 and msg == Msg.PROCS:
                        records = decode_procs(payload)
                        if self.on_procs is not None:
                            self.on_procs(records)
                        continue
                    if channel & STREAM_BIT or channel in self._streams:
                        self._stream_frame(channel, msg, payload)
                        continue
                    if channel == 0 and msg == Msg.EXECDENIED:
                        denied = decode_exec_denied(payload)
                        if self.on_exec_denied is not None:
                            self.on_exec_denied(denied)
                        continue
                    ch = self._channels.get(channel)
                    if ch is None:
                        continue  # replies to finished requests are dropped
                    if msg in _FLOWING and self.flow_control:
                        ch.pending += len(payload)
                        if ch.pending > WINDOW:
                            raise ProtocolError(f"the guest ignored flow control on {channel}")
                    ch.queue.put_nowait((msg, payload))
        except ProtocolError as exc:
            self._fail(errors.AgentUnavailable(f"guest broke the protocol: {exc.message}"))
        except errors.CellaError as exc:
            self._fail(exc)
        except (ConnectionError, OSError) as exc:
            self._fail(errors.SandboxCrashed(f"agent channel failed: {exc}"))

    def _fail(self, exc: errors.CellaError) -> None:
        if self._closed is None:
            self._closed = exc
            self._failed.set()
        for ch in self._channels.values():
            ch.queue.put_nowait(_CLOSED)
        for stream in list(self._streams.values()):
            stream._gone()
        self._streams.clear()

    # -- streams the guest opens ----------------------------------------------------------

    def _stream_frame(self, channel: int, msg: int, payload: bytes) -> None:
        stream = self._streams.get(channel)
        if msg == Msg.OWNER and stream is None:
            if len(self._owners) >= _MAX_PENDING_OWNERS:
                raise ProtocolError("owner frames without their streams")
            self._owners[channel] = decode_owner(payload)
            return
        if msg == Msg.SOPEN:
            if stream is not None or len(payload) != 4:
                raise ProtocolError(f"bad stream open on {channel:#x}")
            stream = GuestStream(self, channel, int.from_bytes(payload, "big"))
            stream.owner = self._owners.pop(channel, None)
            stream.opened.set_result(None)
            if self.on_stream is None:
                self._spawn(stream.close())
                return
            self._streams[channel] = stream
            self._spawn(self._serve(stream, self.on_stream))
        elif stream is None:
            if msg != Msg.GSCLOSE:  # the host forgot it (or never knew): tell the guest
                self._spawn(self._send_quiet(channel, Msg.SCLOSE))
        elif msg == Msg.GSDATA:
            stream._feed(payload)
        elif msg == Msg.GACK and len(payload) == 4:
            stream._acked(int.from_bytes(payload, "big"))
        elif msg == Msg.GSCLOSE:
            self._streams.pop(channel, None)
            stream._gone()
        elif msg in (Msg.OK, Msg.ERROR) and not stream.opened.done():
            if msg == Msg.OK:
                stream.opened.set_result(None)
            else:
                self._streams.pop(channel, None)
                stream.opened.set_exception(_guest_error(payload))
        else:
            raise ProtocolError(f"unexpected message {msg:#x} on stream {channel:#x}")

    async def open_port(self, port: int, timeout: float = 10.0) -> GuestStream:
        """A connection to `port` on the guest's loopback (a server the guest runs)."""
        if self._closed is not None:
            raise type(self._closed)(self._closed.message)
        cid = next(self._ids)
        stream = self._streams[cid] = GuestStream(self, cid, port)
        try:
            await self._send(cid, Msg.CONNECT, port.to_bytes(4, "big"))
            await asyncio.wait_for(asyncio.shield(stream.opened), timeout)
        except TimeoutError:
            self._streams.pop(cid, None)
            await self._send_quiet(cid, Msg.SCLOSE)
            raise errors.Timeout(f"port {port} in the guest did not answer") from None
        except BaseException:
            self._streams.pop(cid, None)
            if not stream.opened.done():
                stream.opened.cancel()
                await self._send_quiet(cid, Msg.SCLOSE)
            raise
        return stream

    async def _serve(self, stream: GuestStream, handler: StreamHandler) -> None:
        try:
            await handler(stream)
        except Exception:  # the handler's own failure ends only this stream
            pass
        finally:
            await stream.close()

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._stream_tasks.add(task)
        task.add_done_callback(self._stream_tasks.discard)

    async def _send_quiet(self, cid: int, msg: Msg, payload: bytes = b"") -> None:
        """Sends unless the channel is gone (then there is no one to tell)."""
        with contextlib.suppress(errors.CellaError, ConnectionError, OSError):
            await self._send(cid, msg, payload)

    async def _ack(self, cid: int, ch: _Channel, count: int) -> None:
        """The caller has taken `count` bytes of output: the guest may send that much more."""
        if self.flow_control and count:
            ch.pending -= count
            await self._send_quiet(cid, Msg.ACK, count.to_bytes(4, "big"))

    def _open(self) -> tuple[int, _Channel]:
        if self._closed is not None:
            raise type(self._closed)(self._closed.message)
        cid = next(self._ids)
        ch = self._channels[cid] = _Channel()
        return cid, ch

    def _release(self, cid: int) -> None:
        self._channels.pop(cid, None)

    async def _send(self, cid: int, msg: Msg, payload: bytes = b"") -> None:
        if self._closed is not None:
            raise type(self._closed)(self._closed.message)
        self._writer.write(frame(cid, msg, payload))
        await self._writer.drain()

    async def _next(self, ch: _Channel, timeout: float | None = None) -> tuple[int, bytes]:
        try:
            item = await asyncio.wait_for(ch.queue.get(), timeout)
        except TimeoutError:
            raise errors.Timeout("the guest agent did not answer in time") from None
        if item is _CLOSED:
            assert self._closed is not None
            raise type(self._closed)(self._closed.message)
        assert isinstance(item, tuple)
        return item

    async def _request(
        self, msg: Msg, payload: bytes, timeout: float | None = 30.0
    ) -> tuple[int, bytes]:
        cid, ch = self._open()
        try:
            await self._send(cid, msg, payload)
            reply, body = await self._next(ch, timeout)
            if reply == Msg.ERROR:
                raise _guest_error(body)
            return reply, body
        finally:
            self._release(cid)

    # -- basic ---------------------------------------------------------------------------

    async def ping(self, timeout: float | None = 30.0) -> str:
        """The agent's version string; it also tells whether the agent speaks flow control."""
        reply, body = await self._request(Msg.PING, b"", timeout)
        if reply != Msg.PONG:
            raise errors.AgentUnavailable(f"unexpected reply {reply:#x} to ping")
        version = body.decode("utf-8", "replace")
        self.flow_control = version != "cella-agent/1"
        return version

    async def set_identity(
        self,
        *,
        hostname: str | None = None,
        time_ns: int | None = None,
        seed: bytes | None = None,
        sandbox_id: str | None = None,
        pids_max: int | None = None,
    ) -> None:
        """Fresh identity after a restore or fork: hostname, wall clock, entropy, id, and
        the sandbox's process limit (0 lifts it)."""
        items: list[tuple[Field, bytes | str | int | bool]] = []
        if pids_max is not None:
            items.append((Field.PIDS_MAX, pids_max))
        if sandbox_id is not None:
            items.append((Field.SANDBOX_ID, sandbox_id))
        if hostname is not None:
            items.append((Field.HOSTNAME, hostname))
        if time_ns is not None:
            items.append((Field.TIME_NS, time_ns))
        if seed is not None:
            items.append((Field.SEED, seed))
        await self._expect_ok(Msg.IDENTITY, fields(items))

    async def set_exec_policy(
        self, deny_by_default: bool, rules: Sequence[tuple[bool, str, str]]
    ) -> None:
        """The guest's exec policy: rules in order, each (deny, "path_glob" | "sha256",
        value); the first that matches an executable decides, else the default. No rules
        and allow by default: nothing is checked."""
        items: list[tuple[Field, bytes | str | int | bool]] = [
            (Field.POL_DEFAULT, int(deny_by_default))
        ]
        for deny, kind, value in rules:
            head = (b"d" if deny else b"a") + (b"h" if kind == "sha256" else b"p")
            raw = bytes.fromhex(value) if kind == "sha256" else value.encode()
            items.append((Field.POL_RULE, head + raw))
        await self._expect_ok(Msg.POLICY, fields(items))

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Asks the guest to sync its disks and power off."""
        await self._expect_ok(Msg.SHUTDOWN, b"", timeout)

    async def _expect_ok(self, msg: Msg, payload: bytes, timeout: float | None = 30.0) -> bytes:
        reply, body = await self._request(msg, payload, timeout)
        if reply != Msg.OK:
            raise errors.AgentUnavailable(f"unexpected reply {reply:#x}")
        return body

    # -- exec ----------------------------------------------------------------------------

    async def exec_stream(
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
    ) -> AsyncIterator[ExecEvent]:
        """Runs a command; yields Started, then Output as produced, then the ExitStatus
        (with the files the command changed, when the agent reports them).

        A string is run by `/bin/sh -c` (that shell itself is not held to the exec policy;
        what it runs is). `exempt`: the daemon's own upkeep, which the sandbox's exec
        policy does not hold; a caller's command passes False. With a timeout the guest
        kills the whole process tree (its cgroup) when it expires and reports `timed_out`.
        `pty=(cols, rows)` runs it in a terminal (its output is all "stdout"; stdin ending
        sends the EOF character). `control` can signal it and resize its terminal while it
        runs. With `trace` the guest reports the processes it starts (up to that many in
        full, the rest counted) to `on_procs`, naming the channel `Started` carries.
        """
        args = ["/bin/sh", "-c", argv] if isinstance(argv, str) else list(argv)
        items: list[tuple[Field, bytes | str | int | bool]] = [(Field.ARG, a) for a in args]
        if isinstance(argv, str):
            items.append((Field.WRAPPER, True))
        if exempt:
            items.append((Field.EXEMPT, True))
        items += [(Field.ENV, f"{key}={value}") for key, value in (env or {}).items()]
        if cwd is not None:
            items.append((Field.CWD, cwd))
        if user is not None:
            items.append((Field.USER, user))
        if timeout is not None:
            items.append((Field.TIMEOUT_MS, max(1, int(timeout * 1000))))
        if stdin is not None:
            items.append((Field.STDIN, True))
        if pty is not None:
            items.append((Field.PTY, (pty[0] & 0xFFFF) << 16 | (pty[1] & 0xFFFF)))
        if trace:
            items.append((Field.TRACE, trace))
        cid, ch = self._open()
        feeder: asyncio.Task[None] | None = None
        running = False
        try:
            await self._send(cid, Msg.EXEC, fields(items))
            reply, body = await self._next(ch, 30.0)
            if reply == Msg.ERROR:
                raise _guest_error(body)
            if reply != Msg.STARTED or len(body) != 4:
                raise errors.AgentUnavailable(f"unexpected reply {reply:#x} to exec")
            running = True
            if control is not None:
                control._bind(self, cid)
            yield Started(int.from_bytes(body, "big"), cid)
            if stdin is not None:
                feeder = asyncio.create_task(self._feed_stdin(cid, stdin))
            wait = None if timeout is None else timeout + _TIMEOUT_GRACE
            changes: list[FileChange] | None = None
            dropped = 0
            while True:
                reply, body = await self._next(ch, wait)
                if reply in (Msg.STDOUT, Msg.STDERR):
                    yield Output("stdout" if reply == Msg.STDOUT else "stderr", body)
                    await self._ack(cid, ch, len(body))  # taken: the guest may send more
                elif reply == Msg.FSCHANGES:
                    left_out, more = decode_file_changes(body)
                    changes = changes or []
                    room = max(0, MAX_FILE_CHANGES - len(changes))
                    changes += more[:room]
                    dropped = max(dropped, left_out) + max(0, len(more) - room)
                elif reply == Msg.EXIT:
                    running = False
                    status = decode_exit(body)
                    if changes is not None:
                        status = replace(
                            status, file_changes=tuple(changes), changes_dropped=dropped
                        )
                    yield status
                    return
                else:
                    raise errors.AgentUnavailable(f"unexpected reply {reply:#x} during exec")
        finally:
            if control is not None:
                control._bind(self, None)
            if feeder is not None:
                feeder.cancel()
            if running and self._closed is None:
                # the caller stopped listening early: do not leave the process running
                with contextlib.suppress(Exception):
                    await self._send(cid, Msg.KILL, (9).to_bytes(4, "big"))
            self._release(cid)

    async def _feed_stdin(self, cid: int, stdin: bytes | AsyncIterable[bytes]) -> None:
        async for chunk in _chunks(stdin):
            if chunk:
                await self._send(cid, Msg.STDIN, chunk)
        await self._send(cid, Msg.STDIN, b"")

    async def exec(
        self,
        argv: Sequence[str] | str,
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        user: str | None = None,
        stdin: bytes | AsyncIterable[bytes] | None = None,
        timeout: float | None = None,
    ) -> ExecResult:
        """Runs a command to completion; all of its output is kept."""
        output = OutputCollector()
        start = time.perf_counter()
        status: ExitStatus | None = None
        async for event in self.exec_stream(
            argv, cwd=cwd, env=env, user=user, stdin=stdin, timeout=timeout
        ):
            if isinstance(event, Output):
                output.add(event.stream, event.data)
            elif isinstance(event, ExitStatus):
                status = event
        assert status is not None
        duration_ms = (time.perf_counter() - start) * 1000
        return output.result(status.exit_code, status.signal, status.timed_out, duration_ms)

    # -- files ---------------------------------------------------------------------------

    async def read_stream(self, path: str) -> AsyncIterator[bytes]:
        cid, ch = self._open()
        try:
            await self._send(cid, Msg.READ, fields([(Field.PATH, path)]))
            while True:
                reply, body = await self._next(ch, 60.0)
                if reply == Msg.DATA:
                    yield body
                    await self._ack(cid, ch, len(body))
                elif reply == Msg.END:
                    return
                elif reply == Msg.ERROR:
                    raise _guest_error(body)
                else:
                    raise errors.AgentUnavailable(f"unexpected reply {reply:#x} to read")
        finally:
            self._release(cid)

    async def read_file(self, path: str) -> bytes:
        return b"".join([chunk async for chunk in self.read_stream(path)])

    async def write_file(
        self,
        path: str,
        data: bytes | AsyncIterable[bytes] | Iterable[bytes],
        *,
        mode: int = 0o644,
        parents: bool = False,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        """Writes atomically: the guest writes a temporary file (with `metadata` as its
        extended attributes) and renames it into place."""
        items: list[tuple[Field, bytes | str | int | bool]] = [
            (Field.PATH, path),
            (Field.MODE, mode),
        ]
        if parents:
            items.append((Field.PARENTS, True))
        for key, value in (metadata or {}).items():
            items.append((Field.XATTR, key.encode() + b"\0" + value.encode()))
        cid, ch = self._open()
        try:
            await self._send(cid, Msg.WRITE, fields(items))
            try:
                async for chunk in _chunks(data):
                    await self._send(cid, Msg.WDATA, chunk)
            except BaseException:
                # the source failed (or was too large): the guest drops its temporary file
                if self._closed is None:
                    await self._send(cid, Msg.WEND, b"\x01")
                raise
            await self._send(cid, Msg.WEND)
            reply, body = await self._next(ch, 60.0)
            if reply == Msg.ERROR:
                raise _guest_error(body)
            if reply != Msg.OK:
                raise errors.AgentUnavailable(f"unexpected reply {reply:#x} to write")
        finally:
            self._release(cid)

    async def list_dir(self, path: str, *, metadata: bool = False) -> list[Entry]:
        cid, ch = self._open()
        entries: list[Entry] = []
        try:
            await self._send(cid, Msg.LIST, fields(_path_items(path, metadata)))
            while True:
                reply, body = await self._next(ch, 60.0)
                if reply == Msg.DATA:
                    entries.extend(decode_entries(body))
                    await self._ack(cid, ch, len(body))
                elif reply == Msg.END:
                    return sorted(entries, key=lambda e: e.name)
                elif reply == Msg.ERROR:
                    raise _guest_error(body)
                else:
                    raise errors.AgentUnavailable(f"unexpected reply {reply:#x} to list")
        finally:
            self._release(cid)

    async def stat(self, path: str, *, metadata: bool = False) -> Entry:
        body = await self._expect_ok(Msg.STAT, fields(_path_items(path, metadata)))
        entries = decode_entries(body)
        if len(entries) != 1:
            raise errors.AgentUnavailable("malformed stat reply")
        return entries[0]

    async def mkdir(self, path: str, *, mode: int = 0o755, parents: bool = False) -> None:
        items: list[tuple[Field, bytes | str | int | bool]] = [
            (Field.PATH, path),
            (Field.MODE, mode),
        ]
        if parents:
            items.append((Field.PARENTS, True))
        await self._expect_ok(Msg.MKDIR, fields(items))

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        items: list[tuple[Field, bytes | str | int | bool]] = [(Field.PATH, path)]
        if recursive:
            items.append((Field.RECURSIVE, True))
        await self._expect_ok(Msg.REMOVE, fields(items), timeout=300.0)

    async def chmod(self, path: str, mode: int) -> None:
        await self._expect_ok(Msg.CHMOD, fields([(Field.PATH, path), (Field.MODE, mode & 0o7777)]))

    async def tar_out(self, path: str) -> AsyncIterator[bytes]:
        """Streams the directory at `path` as an uncompressed tar archive."""
        entry = await self.stat(path)
        if entry.kind != "dir":
            raise errors.NotADirectory(f"{path}: not a directory")
        stderr = bytearray()
        async for event in self.exec_stream(["tar", "-c", "-C", path, "."]):
            if isinstance(event, Output):
                if event.stream == "stdout":
                    yield event.data
                else:
                    stderr.extend(event.data)
            elif isinstance(event, ExitStatus) and event.exit_code != 0:
                raise errors.GuestError(f"tar failed: {stderr.decode(errors='replace')[:500]}")

    async def tar_in(
        self, path: str, archive: bytes | AsyncIterable[bytes], *, timeout: float | None = None
    ) -> None:
        """Unpacks a tar archive into the directory at `path` (created if missing).

        GNU tar in the guest refuses members that climb out of the target; either way
        it only ever touches the guest's own file system.
        """
        await self.mkdir(path, parents=True)
        result = await self.exec(
            ["tar", "-x", "--no-same-owner", "-C", path], stdin=archive, timeout=timeout
        )
        if result.exit_code != 0:
            raise errors.InvalidArgument(
                f"could not unpack archive: {result.stderr.decode(errors='replace')[:500]}"
            )


async def _chunks(data: bytes | AsyncIterable[bytes] | Iterable[bytes]) -> AsyncIterator[bytes]:
    """Any byte source, cut to frame-sized pieces."""
    if isinstance(data, bytes):
        sources: AsyncIterable[bytes] | Iterable[bytes] = [data]
    else:
        sources = data
    if isinstance(sources, AsyncIterable):
        async for piece in sources:
            for off in range(0, len(piece), CHUNK):
                yield piece[off : off + CHUNK]
    else:
        for piece in sources:
            for off in range(0, len(piece), CHUNK):
                yield piece[off : off + CHUNK]


def _guest_error(body: bytes) -> errors.CellaError:
    err, message = decode_error(body)
    if err == 0:
        return errors.AgentUnavailable(message)
    return errors.from_errno(err, message)


def _path_items(path: str, metadata: bool) -> list[tuple[Field, bytes | str | int | bool]]:
    """A stat's or a listing's fields: the path, and whether to report metadata (an agent
    older than metadata ignores the flag and reports none)."""
    items: list[tuple[Field, bytes | str | int | bool]] = [(Field.PATH, path)]
    if metadata:
        items.append((Field.XATTRS, True))
    return items
