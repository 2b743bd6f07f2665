"""The LangSmith data plane's TCP tunnels: yamux over a WebSocket, each stream opening a
connection to a guest port (`ports` room) with a one-byte answer."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, WebSocket
from starlette.websockets import WebSocketDisconnect

from cella import errors
from cella.server.compat.langsmith.waking import awake
from cella.server.compat.langsmith.yamux import YamuxSession, YamuxStream
from cella.server.deps import daemon
from cella.server.sockets import api_key, opened
from cella.service.keys import Principal

TUNNEL_OK, TUNNEL_DIAL_FAILED, TUNNEL_BAD_VERSION = b"\x00", b"\x02", b"\x03"


router = APIRouter(include_in_schema=False)


@router.websocket("/tunnel")
async def tunnel(ws: WebSocket, sandbox_id: str) -> None:
    await serve_tunnel(ws, sandbox_id)


async def serve_tunnel(ws: WebSocket, sandbox_id: str) -> None:
    svc = daemon(ws)

    async def caller() -> Principal:
        who = api_key(ws)
        await awake(svc, who, sandbox_id)
        return who

    who = await opened(ws, caller)
    if who is None:
        return

    async def carry(stream: YamuxStream) -> None:
        head = b""
        while len(head) < 3:
            more = await stream.read()
            if not more:
                return
            head += more
        version, port, rest = head[0], int.from_bytes(head[1:3], "big"), head[3:]
        if version != 1:
            await stream.write(TUNNEL_BAD_VERSION)
            return
        try:
            guest = await svc.ports.open(who, sandbox_id, port)
        except errors.CellaError:
            await stream.write(TUNNEL_DIAL_FAILED)
            return
        await stream.write(TUNNEL_OK)

        async def up() -> None:
            if rest:
                await guest.write(rest)
            while data := await stream.read():
                await guest.write(data)
            await guest.write_eof()

        async def down() -> None:
            while data := await guest.read():
                await stream.write(data)
            await stream.close_write()

        try:
            await asyncio.gather(up(), down())
        except (ConnectionError, errors.CellaError):
            await stream.reset()
        finally:
            await guest.close()

    session = YamuxSession(ws.send_bytes, carry)
    try:
        while not session.closed:
            message = await ws.receive()
            if message["type"] == "websocket.disconnect":
                break
            data = message.get("bytes") or (message.get("text") or "").encode()
            await session.feed(data)
    except (WebSocketDisconnect, RuntimeError):
        pass
    finally:
        await session.close()
