"""Server side of the yamux stream multiplexer (hashicorp/yamux spec), as the LangSmith SDK's
TCP tunnel speaks it (`langsmith/sandbox/_yamux.py` is the client).

A frame is a 12-byte big-endian header - version (u8, 0), type (u8), flags (u16), stream id
(u32), length (u32) - followed, for DATA only, by `length` bytes of payload. For WINDOW_UPDATE
the length is a window delta, for PING an opaque value, for GO_AWAY an error code.

We are the server: the client opens streams (odd ids) with SYN and we acknowledge each with
WINDOW_UPDATE|ACK; we never open streams. Each side starts with a 256 KiB receive window per
stream and grants more with WINDOW_UPDATE as its application consumes data. The peer is
untrusted: a peer that sends past our window, or malformed frames, ends the session (GO_AWAY
with a protocol error), so the bytes buffered for a stream never exceed its window.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from collections import OrderedDict
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

HEADER = struct.Struct(">BBHII")  # version, type, flags, stream id, length
VERSION = 0

TYPE_DATA = 0
TYPE_WINDOW_UPDATE = 1
TYPE_PING = 2
TYPE_GO_AWAY = 3

FLAG_SYN = 0x1
FLAG_ACK = 0x2
FLAG_FIN = 0x4
FLAG_RST = 0x8

GO_AWAY_NORMAL = 0
GO_AWAY_PROTOCOL_ERROR = 1
GO_AWAY_INTERNAL_ERROR = 2

INITIAL_WINDOW = 256 * 1024
# Largest DATA payload we send in one frame (one transport message): keeps messages well under
# the client's 1 MiB WebSocket limit and lets streams interleave.
MAX_FRAME_PAYLOAD = 64 * 1024
_GO_AWAY_TIMEOUT = 5.0


def encode_header(msg_type: int, flags: int, stream_id: int, length: int) -> bytes:
    return HEADER.pack(VERSION, msg_type, flags, stream_id, length)


class YamuxStream:
    """One client-opened stream. Its handler (`on_stream`) owns it; the session closes it (FIN
    if still open) and forgets it when the handler returns."""

    def __init__(self, session: YamuxSession, stream_id: int) -> None:
        self.id = stream_id
        self._session = session
        self._buf = bytearray()
        self._readable = asyncio.Event()
        self._recv_window = INITIAL_WINDOW  # bytes the peer may still send us
        self._consumed = 0  # read by the application since our last WINDOW_UPDATE
        self._eof = False  # peer sent FIN
        self._send_window = INITIAL_WINDOW  # bytes we may still send the peer
        self._writable = asyncio.Event()
        self._writable.set()
        self._write_lock = asyncio.Lock()
        self._fin_sent = False
        self._reset = False  # RST either way, or the session ended

    def __repr__(self) -> str:
        return f"<YamuxStream {self.id}>"

    async def read(self, n: int = -1) -> bytes:
        """The next buffered data (at most `n` bytes if `n` > 0); b"" at EOF (the peer's FIN)
        or once the stream is reset or the session is closed."""
        while not self._buf and not self._eof and not self._reset:
            self._readable.clear()
            await self._readable.wait()
        if self._reset or not self._buf:
            return b""
        if 0 < n < len(self._buf):
            data = bytes(self._buf[:n])
            del self._buf[:n]
        else:
            data = bytes(self._buf)
            self._buf.clear()
        self._consumed += len(data)
        if self._consumed >= INITIAL_WINDOW // 2 and not self._eof:
            delta, self._consumed = self._consumed, 0
            self._recv_window += delta
            with contextlib.suppress(ConnectionError):  # session gone: the next read says so
                await self._session._send_frame(TYPE_WINDOW_UPDATE, 0, self.id, delta)
        return data

    async def readexactly(self, n: int) -> bytes:
        """Exactly `n` bytes; asyncio.IncompleteReadError if the stream ends first."""
        got = bytearray()
        while len(got) < n:
            chunk = await self.read(n - len(got))
            if not chunk:
                raise asyncio.IncompleteReadError(bytes(got), n)
            got += chunk
        return bytes(got)

    async def write(self, data: bytes) -> None:
        """Send `data`, never past the peer's receive window (waits for its WINDOW_UPDATE).
        ConnectionResetError once the stream is reset, half-closed by us, or the session ends."""
        view = memoryview(data)
        async with self._write_lock:
            while True:
                while self._send_window <= 0 and not (self._reset or self._session.closed):
                    self._writable.clear()
                    await self._writable.wait()
                if self._reset or self._fin_sent or self._session.closed:
                    raise ConnectionResetError(f"yamux stream {self.id} is closed")
                if not view:
                    return
                size = min(len(view), self._send_window, MAX_FRAME_PAYLOAD)
                self._send_window -= size
                chunk, view = view[:size], view[size:]
                await self._session._send_frame(TYPE_DATA, 0, self.id, size, chunk)

    async def close_write(self) -> None:
        """Half-close: send FIN. Reading stays possible until the peer's FIN."""
        if self._fin_sent or self._reset or self._session.closed:
            return
        async with self._write_lock:  # after any write in progress
            if self._fin_sent or self._reset or self._session.closed:
                return
            self._fin_sent = True
            await self._session._send_frame(TYPE_DATA, FLAG_FIN, self.id, 0)

    async def reset(self) -> None:
        """Abort the stream both ways: send RST and drop buffered data."""
        if self._reset:
            return
        self._mark_reset()
        if not self._session.closed:
            await self._session._send_frame(TYPE_WINDOW_UPDATE, FLAG_RST, self.id, 0)

    # -- driven by the session -------------------------------------------------------------

    def _mark_reset(self) -> None:
        self._reset = True
        self._buf.clear()
        self._readable.set()
        self._writable.set()

    def _mark_eof(self) -> None:
        self._eof = True
        self._readable.set()

    def _grant(self, delta: int) -> None:
        self._send_window += delta
        self._writable.set()


class YamuxSession:
    """A yamux server session over one transport. Feed it the bytes the transport receives;
    it writes through `send` and runs `on_stream` as a task for each stream the client opens.

    After `feed` returns, check `closed`: a GO_AWAY from the client or a protocol error closes
    the session, and the caller should then call `close()` and drop the transport."""

    def __init__(
        self,
        send: Callable[[bytes], Awaitable[None]],
        on_stream: Callable[[YamuxStream], Awaitable[None]],
        *,
        max_streams: int = 256,
    ) -> None:
        self._send = send
        self._on_stream = on_stream
        self._max_streams = max_streams
        self._streams: dict[int, YamuxStream] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        # Ids of streams lately closed (or refused), so that the frames still in flight for
        # them are dropped quietly; bounded.
        self._recently_closed: OrderedDict[int, None] = OrderedDict()
        self._recently_closed_max = max(1024, 4 * max_streams)
        self._inbuf = bytearray()
        self._feed_lock = asyncio.Lock()
        self._send_lock = asyncio.Lock()
        self._go_away_sent = False
        self.closed = False

    # -- transport in ----------------------------------------------------------------------

    async def feed(self, data: bytes) -> None:
        """Bytes received from the transport, split or coalesced anyhow."""
        async with self._feed_lock:
            if self.closed:
                return
            buf = self._inbuf
            buf += data
            pos = 0
            while not self.closed and len(buf) - pos >= HEADER.size:
                version, msg_type, flags, stream_id, length = HEADER.unpack_from(buf, pos)
                if version != VERSION or msg_type > TYPE_GO_AWAY:
                    await self._protocol_error(f"bad frame header {bytes(buf[pos : pos + 12])!r}")
                    break
                payload = b""
                if msg_type == TYPE_DATA:
                    # Never more than a window in flight, so never buffer more than that.
                    if length > INITIAL_WINDOW:
                        await self._protocol_error(f"{length}-byte frame exceeds the window")
                        break
                    if len(buf) - pos < HEADER.size + length:
                        break  # wait for the rest of the payload
                    payload = bytes(buf[pos + HEADER.size : pos + HEADER.size + length])
                    pos += HEADER.size + length
                else:
                    pos += HEADER.size
                try:
                    await self._handle(msg_type, flags, stream_id, length, payload)
                except ConnectionResetError:
                    if not self.closed:
                        raise
            if self.closed:
                buf.clear()
            else:
                del buf[:pos]

    async def _handle(
        self, msg_type: int, flags: int, stream_id: int, length: int, payload: bytes
    ) -> None:
        if msg_type == TYPE_PING:
            if flags & FLAG_SYN:
                await self._send_frame(TYPE_PING, FLAG_ACK, 0, length)
            return
        if msg_type == TYPE_GO_AWAY:
            log.debug("yamux: client sent GO_AWAY (code %d)", length)
            self._shutdown(eof=True)
            return
        if stream_id == 0:
            await self._protocol_error(f"type {msg_type} frame on stream 0")
            return

        if flags & FLAG_SYN and not await self._open_stream(stream_id):
            return  # refused (RST sent) or session closed; payload dropped
        stream = self._streams.get(stream_id)
        if stream is None:
            # A frame for a stream we don't have. Frames trailing a stream that we have already
            # closed and forgotten (the client's late WINDOW_UPDATE, its FIN) are dropped quietly;
            # data there, or anything on a stream never opened, gets RST.
            if flags & (FLAG_RST | FLAG_FIN):
                return
            if stream_id in self._recently_closed and not payload:
                return
            await self._send_frame(TYPE_WINDOW_UPDATE, FLAG_RST, stream_id, 0)
            return

        if msg_type == TYPE_WINDOW_UPDATE:
            if length:
                stream._grant(length)
        elif payload:
            if len(payload) > stream._recv_window:
                await self._protocol_error(
                    f"stream {stream_id}: {len(payload)} bytes past a "
                    f"{stream._recv_window}-byte window"
                )
                return
            stream._recv_window -= len(payload)
            if stream._reset:
                pass  # we reset it; the peer hasn't seen our RST yet
            elif stream._eof:
                await stream.reset()  # data after its own FIN
            else:
                stream._buf += payload
                stream._readable.set()
        if flags & FLAG_RST:
            stream._mark_reset()
        elif flags & FLAG_FIN:
            stream._mark_eof()

    async def _open_stream(self, stream_id: int) -> bool:
        if stream_id in self._streams:
            await self._protocol_error(f"SYN for open stream {stream_id}")
            return False
        # Clients open odd ids. Not necessarily in order: the SDK's client picks ids under a
        # lock but sends the SYNs outside it, so concurrent opens can arrive 3 before 1.
        if stream_id % 2 == 0 or len(self._streams) >= self._max_streams:
            log.debug("yamux: refusing stream %d, %d open", stream_id, len(self._streams))
            self._forget(stream_id)
            await self._send_frame(TYPE_WINDOW_UPDATE, FLAG_RST, stream_id, 0)
            return False
        self._recently_closed.pop(stream_id, None)
        stream = YamuxStream(self, stream_id)
        self._streams[stream_id] = stream
        await self._send_frame(TYPE_WINDOW_UPDATE, FLAG_ACK, stream_id, 0)
        task = asyncio.create_task(self._run(stream), name=f"yamux-stream-{stream_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    async def _run(self, stream: YamuxStream) -> None:
        failed = False
        try:
            await self._on_stream(stream)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if isinstance(e, ConnectionError) and (stream._reset or self.closed):
                log.debug("yamux: stream %d ended: %r", stream.id, e)
            else:
                log.exception("yamux: handler for stream %d failed", stream.id)
            failed = True
        finally:
            self._streams.pop(stream.id, None)
            self._forget(stream.id)
        # Not on cancellation: only close() cancels, and the session is gone then.
        with contextlib.suppress(Exception):
            if failed:
                await stream.reset()
            else:
                await stream.close_write()
        stream._mark_reset()

    def _forget(self, stream_id: int) -> None:
        self._recently_closed[stream_id] = None
        self._recently_closed.move_to_end(stream_id)
        while len(self._recently_closed) > self._recently_closed_max:
            self._recently_closed.popitem(last=False)

    # -- transport out ---------------------------------------------------------------------

    async def _send_frame(
        self,
        msg_type: int,
        flags: int,
        stream_id: int,
        length: int,
        payload: bytes | memoryview = b"",
    ) -> None:
        frame = encode_header(msg_type, flags, stream_id, length)
        if payload:
            frame += payload
        async with self._send_lock:
            if self.closed:
                raise ConnectionResetError("yamux session is closed")
            try:
                await self._send(frame)
            except Exception as e:
                # A transport that can't send is gone; so is the session.
                if not self.closed:
                    log.debug("yamux: transport send failed: %r", e)
                    self._go_away_sent = True
                    self._shutdown(eof=False)
                raise ConnectionResetError("yamux transport failed") from e

    async def _protocol_error(self, why: str) -> None:
        log.warning("yamux: protocol error, closing session: %s", why)
        await self.close(GO_AWAY_PROTOCOL_ERROR)

    # -- shutdown --------------------------------------------------------------------------

    def _shutdown(self, *, eof: bool) -> None:
        """Mark the session closed and wake every stream: readers see the end (after what is
        buffered if `eof`, at once otherwise), writers fail."""
        self.closed = True
        self._inbuf.clear()
        for stream in self._streams.values():
            if eof:
                stream._mark_eof()
                stream._writable.set()
            else:
                stream._mark_reset()

    async def close(self, code: int = GO_AWAY_NORMAL) -> None:
        """Send GO_AWAY (once), reset every stream and cancel (and await) the stream tasks."""
        self._shutdown(eof=False)
        if not self._go_away_sent:
            self._go_away_sent = True
            try:
                async with asyncio.timeout(_GO_AWAY_TIMEOUT), self._send_lock:
                    await self._send(encode_header(TYPE_GO_AWAY, 0, 0, code))
            except Exception as e:  # the transport may well be gone already
                log.debug("yamux: GO_AWAY not sent: %r", e)
        current = asyncio.current_task()
        tasks = [t for t in self._tasks if t is not current]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self._streams.clear()
