"""The yamux server behind the LangSmith tunnel: driven by the SDK's own (threaded) yamux client,
then by hand-built frames for what a well-behaved client never sends."""

from __future__ import annotations

import asyncio
import os
import queue
import struct
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest
from langsmith.sandbox import _yamux as sdk_yamux
from langsmith.sandbox._tunnel import _read_status, _write_connect_header, _WSAdapter

from cella.server.compat.langsmith.yamux import (
    FLAG_ACK,
    FLAG_FIN,
    FLAG_RST,
    FLAG_SYN,
    GO_AWAY_NORMAL,
    GO_AWAY_PROTOCOL_ERROR,
    HEADER,
    INITIAL_WINDOW,
    TYPE_DATA,
    TYPE_GO_AWAY,
    TYPE_PING,
    TYPE_WINDOW_UPDATE,
    YamuxSession,
    YamuxStream,
)

Frame = tuple[int, int, int, int, bytes]  # type, flags, stream id, length, payload
T = TypeVar("T")


def frame(
    msg_type: int, flags: int, stream_id: int, length: int = 0, payload: bytes = b""
) -> bytes:
    if msg_type == TYPE_DATA:
        length = len(payload)
    return HEADER.pack(0, msg_type, flags, stream_id, length) + payload


def parse(data: bytes) -> list[Frame]:
    frames, pos = [], 0
    while pos < len(data):
        _, msg_type, flags, sid, length = HEADER.unpack_from(data, pos)
        pos += HEADER.size
        payload = b""
        if msg_type == TYPE_DATA:
            payload, pos = data[pos : pos + length], pos + length
        frames.append((msg_type, flags, sid, length, payload))
    return frames


async def settle() -> None:
    for _ in range(50):
        await asyncio.sleep(0)


async def until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


def in_thread(fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
    """Run blocking SDK code on a daemon thread (unlike asyncio.to_thread, a thread stuck after
    a failure can't hang the test run's exit)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def settle_fut(ok: bool, value: Any) -> None:
        if fut.done():
            return
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)

    def run() -> None:
        try:
            result = fn(*args)
        except BaseException as e:
            loop.call_soon_threadsafe(settle_fut, False, e)
        else:
            loop.call_soon_threadsafe(settle_fut, True, result)

    threading.Thread(target=run, daemon=True).start()
    return fut


# -- the SDK's client against our server -------------------------------------------------------


class FakeWS:
    """What the SDK's `_WSAdapter` wraps (blocking recv/send/close, called from its threads),
    joined to a server session on the test's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, inbound: asyncio.Queue[bytes | None]):
        self._loop = loop
        self._inbound = inbound
        self.to_client: queue.Queue[bytes | None] = queue.Queue()

    def recv(self) -> bytes:
        msg = self.to_client.get()
        if msg is None:
            raise ConnectionError("websocket closed")
        return msg

    def send(self, data: bytes) -> None:
        self._loop.call_soon_threadsafe(self._inbound.put_nowait, bytes(data))

    def close(self) -> None:
        self.to_client.put(None)
        self._loop.call_soon_threadsafe(self._inbound.put_nowait, None)


class Tunnel:
    def __init__(self, on_stream: Callable[[YamuxStream], Awaitable[None]]) -> None:
        self.loop = asyncio.get_running_loop()
        self.inbound: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.ws = FakeWS(self.loop, self.inbound)
        self.server_out = bytearray()  # everything the server sent, for inspection
        self.session = YamuxSession(self._send, on_stream)
        self.pump = asyncio.create_task(self._pump())
        self.client = sdk_yamux.YamuxSession(_WSAdapter(self.ws))

    async def _send(self, data: bytes) -> None:
        self.server_out += data
        self.ws.to_client.put(data)

    async def _pump(self) -> None:
        while (data := await self.inbound.get()) is not None:
            await self.session.feed(data)
            if self.session.closed:
                break
        await self.session.close()

    async def aclose(self) -> None:
        self.client.close()
        await asyncio.wait_for(self.pump, 10)


async def tunnel_handler(stream: YamuxStream) -> None:
    """Answers the tunnel's connect header like the daemon does; port 1 echoes, port 2 sends a
    greeting, half-closes, and keeps what the client sends after that."""
    version, port = struct.unpack(">BH", await stream.readexactly(3))
    assert version == 1
    await stream.write(b"\x00")
    if port == 1:
        while data := await stream.read():
            await stream.write(data)
        await stream.close_write()
    elif port == 2:
        await stream.write(b"hello")
        await stream.close_write()
        rest = bytearray()
        while data := await stream.read():
            rest += data
        after_fin.append(bytes(rest))


after_fin: list[bytes] = []


def client_echo(client: sdk_yamux.YamuxSession, payload: bytes) -> bytes:
    stream = client.open_stream()
    _write_connect_header(stream, 1)  # type: ignore[arg-type]
    assert _read_status(stream) == 0  # type: ignore[arg-type]
    got = bytearray()

    def reader() -> None:
        while len(got) < len(payload) and (chunk := stream.read(65536)):
            got.extend(chunk)

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    for i in range(0, len(payload), 100_000):
        stream.write(payload[i : i + 100_000])
    t.join(timeout=60)
    stream.close()
    return bytes(got)


async def test_sdk_client_round_trips_3_mib_on_3_concurrent_streams() -> None:
    tunnel = Tunnel(tunnel_handler)
    payloads = [os.urandom(3 << 20) for _ in range(3)]
    results = await asyncio.wait_for(
        asyncio.gather(*(in_thread(client_echo, tunnel.client, p) for p in payloads)), 60
    )
    for sent, got in zip(payloads, results, strict=True):
        assert got == sent
    # The client's FIN reached each handler, which returned: the streams are gone.
    await until(lambda: not tunnel.session._streams)
    assert not tunnel.session.closed
    # Both sides had to wait for window updates: we granted the client more than a window.
    granted = sum(
        length
        for t, flags, sid, length, _ in parse(bytes(tunnel.server_out))
        if t == TYPE_WINDOW_UPDATE and not flags & (FLAG_SYN | FLAG_ACK | FLAG_RST)
    )
    assert granted >= 3 * ((3 << 20) - INITIAL_WINDOW)
    await tunnel.aclose()
    assert tunnel.session.closed


async def test_sdk_client_sees_fin_and_can_still_write() -> None:
    after_fin.clear()
    tunnel = Tunnel(tunnel_handler)

    def client() -> bytes:
        stream = tunnel.client.open_stream()
        _write_connect_header(stream, 2)  # type: ignore[arg-type]
        assert _read_status(stream) == 0  # type: ignore[arg-type]
        got = bytearray()
        while chunk := stream.read(1024):  # ends with b"" at the server's FIN
            got += chunk
        stream.write(b"after")  # half-closed: the other direction still works
        stream.close()
        return bytes(got)

    assert await asyncio.wait_for(in_thread(client), 10) == b"hello"
    await until(lambda: after_fin == [b"after"])
    await tunnel.aclose()


async def test_sdk_client_ping_answered_and_go_away_closes() -> None:
    tunnel = Tunnel(tunnel_handler)
    tunnel.client._send_frame(TYPE_PING, FLAG_SYN, 0, 0xDEADBEEF)
    await until(lambda: (TYPE_PING, FLAG_ACK, 0, 0xDEADBEEF, b"") in parse(tunnel.server_out))
    tunnel.client.close()  # GO_AWAY
    await until(lambda: tunnel.session.closed)
    await asyncio.wait_for(tunnel.pump, 10)


# -- hand-built frames -----------------------------------------------------------------------


class Peer:
    """A raw client: feeds frames to a session and collects what it sends back."""

    def __init__(self, handler: Callable[[YamuxStream], Awaitable[None]], **kw: int) -> None:
        self.out = bytearray()
        self.session = YamuxSession(self._send, handler, **kw)

    async def _send(self, data: bytes) -> None:
        self.out += data

    def frames(self) -> list[Frame]:
        return parse(bytes(self.out))

    def take(self) -> list[Frame]:
        frames = self.frames()
        self.out.clear()
        return frames


def blocked(
    release: asyncio.Event, started: list[YamuxStream] | None = None
) -> Callable[[YamuxStream], Awaitable[None]]:
    async def handler(stream: YamuxStream) -> None:
        if started is not None:
            started.append(stream)
        await release.wait()

    return handler


async def test_syn_acked_data_right_after_syn_any_split() -> None:
    got: list[bytes] = []

    async def handler(stream: YamuxStream) -> None:
        got.append(await stream.readexactly(6))

    peer = Peer(handler)
    wire = frame(TYPE_WINDOW_UPDATE, FLAG_SYN, 1) + frame(TYPE_DATA, 0, 1, payload=b"abc")
    wire += frame(TYPE_DATA, FLAG_SYN, 3, payload=b"xyz") + frame(
        TYPE_DATA, FLAG_FIN, 1, payload=b"def"
    )
    for i in range(len(wire)):  # one byte at a time
        await peer.session.feed(wire[i : i + 1])
    await settle()
    assert got == [b"abcdef"]
    frames = peer.frames()
    assert frames[0] == (TYPE_WINDOW_UPDATE, FLAG_ACK, 1, 0, b"")
    assert (TYPE_WINDOW_UPDATE, FLAG_ACK, 3, 0, b"") in frames
    assert (TYPE_DATA, FLAG_FIN, 1, 0, b"") in frames  # handler returned: FIN
    assert list(peer.session._streams) == [3]  # still waiting for its 6 bytes
    await peer.session.close()


async def test_window_overrun_closes_session() -> None:
    release = asyncio.Event()
    started: list[YamuxStream] = []
    peer = Peer(blocked(release, started))  # never reads
    await peer.session.feed(frame(TYPE_WINDOW_UPDATE, FLAG_SYN, 1))
    for _ in range(4):
        await peer.session.feed(frame(TYPE_DATA, 0, 1, payload=bytes(INITIAL_WINDOW // 4)))
    await settle()
    assert not peer.session.closed  # exactly a window: fine
    await peer.session.feed(frame(TYPE_DATA, 0, 1, payload=b"x"))
    assert peer.session.closed
    assert peer.frames()[-1] == (TYPE_GO_AWAY, 0, 0, GO_AWAY_PROTOCOL_ERROR, b"")
    assert await started[0].read() == b""  # reset: buffered data dropped
    assert not peer.session._tasks  # handler cancelled


async def test_oversize_frame_refused_before_its_payload() -> None:
    peer = Peer(blocked(asyncio.Event()))
    await peer.session.feed(frame(TYPE_WINDOW_UPDATE, FLAG_SYN, 1))
    await peer.session.feed(HEADER.pack(0, TYPE_DATA, 0, 1, INITIAL_WINDOW + 1))
    assert peer.session.closed
    assert peer.frames()[-1] == (TYPE_GO_AWAY, 0, 0, GO_AWAY_PROTOCOL_ERROR, b"")


async def test_bad_version_closes_session() -> None:
    peer = Peer(blocked(asyncio.Event()))
    await peer.session.feed(HEADER.pack(1, TYPE_PING, FLAG_SYN, 0, 1))
    assert peer.session.closed


async def test_receive_window_reopens_as_data_is_read() -> None:
    got = bytearray()

    async def handler(stream: YamuxStream) -> None:
        while data := await stream.read():
            got.extend(data)

    peer = Peer(handler)
    await peer.session.feed(frame(TYPE_WINDOW_UPDATE, FLAG_SYN, 1))
    window, total, sent = INITIAL_WINDOW, 2 << 20, 0
    deadline = time.monotonic() + 10
    while sent < total:  # a well-behaved sender: only what the window allows
        for t, flags, sid, length, _ in peer.take():
            if t == TYPE_WINDOW_UPDATE and sid == 1 and not flags:
                window += length
        size = min(window, 50_000, total - sent)
        if size:
            await peer.session.feed(frame(TYPE_DATA, 0, 1, payload=bytes([sent % 251]) * size))
            window -= size
            sent += size
        await asyncio.sleep(0)
        assert time.monotonic() < deadline, "window never reopened"
    await until(lambda: len(got) == total)
    assert not peer.session.closed


async def test_writes_respect_peer_window() -> None:
    done = asyncio.Event()

    async def handler(stream: YamuxStream) -> None:
        await stream.write(bytes(1 << 20))
        done.set()

    def data_sent() -> int:
        return sum(len(p) for t, _, sid, _, p in peer.frames() if t == TYPE_DATA and sid == 1)

    peer = Peer(handler)
    await peer.session.feed(frame(TYPE_WINDOW_UPDATE, FLAG_SYN, 1))
    await settle()
    assert data_sent() == INITIAL_WINDOW and not done.is_set()
    await peer.session.feed(frame(TYPE_WINDOW_UPDATE, 0, 1, 100_000))
    await settle()
    assert data_sent() == INITIAL_WINDOW + 100_000 and not done.is_set()
    await peer.session.feed(frame(TYPE_WINDOW_UPDATE, 0, 1, 1 << 20))
    await until(done.is_set)
    await settle()
    assert data_sent() == 1 << 20
    assert all(len(p) <= INITIAL_WINDOW for t, *_, p in peer.frames() if t == TYPE_DATA)
    assert peer.frames()[-1] == (TYPE_DATA, FLAG_FIN, 1, 0, b"")
    assert 1 not in peer.session._streams  # forgotten


async def test_frames_for_unknown_streams() -> None:
    peer = Peer(blocked(asyncio.Event()))
    await peer.session.feed(frame(TYPE_DATA, 0, 7, payload=b"hi"))
    await peer.session.feed(frame(TYPE_WINDOW_UPDATE, 0, 9, 10))
    assert peer.take() == [
        (TYPE_WINDOW_UPDATE, FLAG_RST, 7, 0, b""),
        (TYPE_WINDOW_UPDATE, FLAG_RST, 9, 0, b""),
    ]
    await peer.session.feed(frame(TYPE_DATA, FLAG_RST, 11) + frame(TYPE_DATA, FLAG_FIN, 13))
    await peer.session.feed(frame(TYPE_WINDOW_UPDATE, FLAG_RST, 15))
    assert peer.take() == []
    assert not peer.session.closed


async def test_late_frames_for_a_finished_stream() -> None:
    async def handler(stream: YamuxStream) -> None:
        await stream.write(b"bye")

    peer = Peer(handler)
    await peer.session.feed(frame(TYPE_WINDOW_UPDATE, FLAG_SYN, 1))
    await settle()
    assert peer.take()[-1] == (TYPE_DATA, FLAG_FIN, 1, 0, b"")
    # The client's trailing window update and FIN: dropped quietly; data: RST.
    await peer.session.feed(frame(TYPE_WINDOW_UPDATE, 0, 1, 3) + frame(TYPE_DATA, FLAG_FIN, 1))
    assert peer.take() == []
    await peer.session.feed(frame(TYPE_DATA, 0, 1, payload=b"more"))
    assert peer.take() == [(TYPE_WINDOW_UPDATE, FLAG_RST, 1, 0, b"")]


async def test_streams_beyond_max_are_reset() -> None:
    release = asyncio.Event()
    peer = Peer(blocked(release), max_streams=2)
    for sid in (3, 1, 5):  # the SDK's concurrent opens may send SYNs out of order
        await peer.session.feed(frame(TYPE_WINDOW_UPDATE, FLAG_SYN, sid))
    assert peer.take() == [
        (TYPE_WINDOW_UPDATE, FLAG_ACK, 3, 0, b""),
        (TYPE_WINDOW_UPDATE, FLAG_ACK, 1, 0, b""),
        (TYPE_WINDOW_UPDATE, FLAG_RST, 5, 0, b""),
    ]
    release.set()  # handlers return: room again
    await settle()
    await peer.session.feed(frame(TYPE_DATA, FLAG_SYN, 7, payload=b"x"))
    assert (TYPE_WINDOW_UPDATE, FLAG_ACK, 7, 0, b"") in peer.take()


async def test_ping_answered_with_same_opaque() -> None:
    peer = Peer(blocked(asyncio.Event()))
    await peer.session.feed(frame(TYPE_PING, FLAG_SYN, 0, 12345) + frame(TYPE_PING, FLAG_ACK, 0, 9))
    assert peer.take() == [(TYPE_PING, FLAG_ACK, 0, 12345, b"")]


async def test_go_away_from_client_ends_streams() -> None:
    outcome: list[object] = []
    ready = asyncio.Event()

    async def handler(stream: YamuxStream) -> None:
        outcome.append(await stream.read())
        ready.set()
        outcome.append(await stream.read())
        try:
            await stream.write(b"x")
        except ConnectionResetError as e:
            outcome.append(e)

    peer = Peer(handler)
    await peer.session.feed(frame(TYPE_DATA, FLAG_SYN, 1, payload=b"a"))
    await asyncio.wait_for(ready.wait(), 5)
    await peer.session.feed(frame(TYPE_GO_AWAY, 0, 0, GO_AWAY_NORMAL))
    assert peer.session.closed
    await settle()
    assert outcome[:2] == [b"a", b""]
    assert isinstance(outcome[2], ConnectionResetError)
    await peer.session.feed(frame(TYPE_WINDOW_UPDATE, FLAG_SYN, 3))  # ignored now
    assert 3 not in peer.session._streams


async def test_peer_reset_ends_stream() -> None:
    outcome: list[object] = []

    async def handler(stream: YamuxStream) -> None:
        outcome.append(await stream.read())
        with pytest.raises(ConnectionResetError):
            await stream.write(b"x")
        outcome.append("raised")

    peer = Peer(handler)
    await peer.session.feed(frame(TYPE_WINDOW_UPDATE, FLAG_SYN, 1))
    await peer.session.feed(frame(TYPE_DATA, FLAG_RST, 1, payload=b"lost"))
    await settle()
    assert outcome == [b"", "raised"]
    assert 1 not in peer.session._streams


async def test_close_sends_go_away_and_cancels_handlers() -> None:
    cancelled = asyncio.Event()

    async def handler(stream: YamuxStream) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    peer = Peer(handler)
    await peer.session.feed(frame(TYPE_WINDOW_UPDATE, FLAG_SYN, 1))
    await settle()
    peer.take()
    await peer.session.close()
    assert cancelled.is_set() and peer.session.closed
    assert peer.take() == [(TYPE_GO_AWAY, 0, 0, GO_AWAY_NORMAL, b"")]
    await peer.session.close()  # idempotent: no second GO_AWAY
    await peer.session.feed(frame(TYPE_PING, FLAG_SYN, 0, 1))
    assert peer.take() == []


async def test_handler_reset_and_failure_send_rst() -> None:
    async def handler(stream: YamuxStream) -> None:
        if stream.id == 1:
            await stream.reset()
        else:
            raise RuntimeError("boom")

    peer = Peer(handler)
    await peer.session.feed(
        frame(TYPE_WINDOW_UPDATE, FLAG_SYN, 1) + frame(TYPE_WINDOW_UPDATE, FLAG_SYN, 3)
    )
    await settle()
    frames = peer.frames()
    assert (TYPE_WINDOW_UPDATE, FLAG_RST, 1, 0, b"") in frames
    assert (TYPE_WINDOW_UPDATE, FLAG_RST, 3, 0, b"") in frames
    assert not any(t == TYPE_DATA and flags & FLAG_FIN for t, flags, *_ in frames)
    assert not peer.session._streams
