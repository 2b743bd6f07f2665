"""A browser's WebSocket to a server inside a sandbox: the daemon accepts the browser's
socket and speaks WebSocket to the guest server over a guest stream (the `websockets`
library's sans-I/O client), relaying messages both ways."""

from __future__ import annotations

import asyncio
import contextlib

from fastapi import WebSocket, WebSocketDisconnect
from websockets.client import ClientProtocol
from websockets.exceptions import InvalidHandshake
from websockets.frames import Frame, Opcode
from websockets.http11 import Response
from websockets.protocol import State
from websockets.uri import parse_uri

from cella.guest.client import GuestStream


async def relay(ws: WebSocket, stream: GuestStream, port: int, target: str) -> None:
    proto = ClientProtocol(parse_uri(f"ws://127.0.0.1:{port}{target}"), max_size=16 << 20)
    proto.send_request(proto.connect())
    await _flush(proto, stream)
    # the guest server's handshake answer decides whether the browser's socket is accepted
    while proto.state is State.CONNECTING:
        data = await stream.read()
        if not data:
            proto.receive_eof()
            break
        proto.receive_data(data)
    early = proto.events_received()  # the handshake answer, and frames right behind it
    handshake = next((e for e in early if isinstance(e, Response)), None)
    if (
        proto.state is not State.OPEN
        or handshake is None
        or isinstance(proto.handshake_exc, InvalidHandshake)
    ):
        await ws.close(code=1011, reason="the server in the sandbox refused the WebSocket")
        await stream.close()
        return
    await ws.accept()

    async def from_browser() -> None:
        with contextlib.suppress(WebSocketDisconnect):
            while True:
                message = await ws.receive()
                if message["type"] == "websocket.disconnect":
                    break
                if message.get("text") is not None:
                    proto.send_text(message["text"].encode())
                elif message.get("bytes") is not None:
                    proto.send_binary(message["bytes"])
                await _flush(proto, stream)
        with contextlib.suppress(Exception):
            proto.send_close(1000)
            await _flush(proto, stream)

    parts: list[bytes] = []
    text = False

    async def deliver(events: list[object]) -> None:
        nonlocal parts, text
        for event in events:
            if not isinstance(event, Frame):
                continue
            if event.opcode in (Opcode.TEXT, Opcode.BINARY):
                parts, text = [bytes(event.data)], event.opcode is Opcode.TEXT
            elif event.opcode is Opcode.CONT:
                parts.append(bytes(event.data))
            else:
                continue  # ping/pong/close: the protocol object answers them
            if event.fin:
                payload = b"".join(parts)
                if text:
                    await ws.send_text(payload.decode())
                else:
                    await ws.send_bytes(payload)

    async def from_guest() -> None:
        await deliver(list(early))
        while data := await stream.read():
            proto.receive_data(data)
            await deliver(list(proto.events_received()))
            await _flush(proto, stream)  # pongs, close answers
            if proto.state is State.CLOSED:
                break
        with contextlib.suppress(RuntimeError):
            await ws.close()

    tasks = [asyncio.ensure_future(from_browser()), asyncio.ensure_future(from_guest())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await stream.close()


async def _flush(proto: ClientProtocol, stream: GuestStream) -> None:
    for data in proto.data_to_send():
        if data:
            await stream.write(data)
