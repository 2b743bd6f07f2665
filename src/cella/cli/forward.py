"""`cella sandbox port-forward`: a local listener whose connections each travel over a
WebSocket to the daemon, which carries them to the port inside the sandbox. An empty
message ends one direction, so half-closed connections behave as over plain TCP."""

from __future__ import annotations

import asyncio
import contextlib

from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from cella.cli._output import console


async def forward(
    url: str, key: str, sandbox_id: str, address: str, local_port: int, remote_port: int
) -> None:
    ws_url = url.replace("http://", "ws://", 1).replace("https://", "wss://", 1)
    target = f"{ws_url}/v1/sandboxes/{sandbox_id}/ports/{remote_port}/connect"

    async def one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with connect(
                target, additional_headers={"Authorization": f"Bearer {key}"}, max_size=None
            ) as ws:

                async def up() -> None:
                    while data := await reader.read(64 << 10):
                        await ws.send(data)
                    await ws.send(b"")  # our end of this direction

                async def down() -> None:
                    async for message in ws:
                        if not message:  # the guest's end of this direction
                            if writer.can_write_eof():
                                writer.write_eof()
                            return
                        writer.write(message if isinstance(message, bytes) else message.encode())
                        await writer.drain()

                with contextlib.suppress(ConnectionClosed):
                    await asyncio.gather(up(), down())
        except OSError as exc:
            console.print(f"[yellow]connection to port {remote_port} failed: {exc}[/yellow]")
        finally:
            writer.close()

    server = await asyncio.start_server(one, address, local_port)
    bound = server.sockets[0].getsockname()
    console.print(
        f"forwarding {bound[0]}:{bound[1]} -> {sandbox_id}:{remote_port} (Ctrl-C to stop)"
    )
    async with server:
        await server.serve_forever()
