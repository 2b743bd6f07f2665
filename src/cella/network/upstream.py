"""A sandbox's own upstream proxy (bring your own): the egress proxy sends that sandbox's
allowed connections through it, SOCKS5 (RFC 1928; user and password, RFC 1929) or HTTP
CONNECT (Basic proxy credentials).

The egress proxy decides and pins a connection as for any sandbox; then `dial` opens the
upstream proxy (at an address the operator's boundary allowed) and asks it for the pinned
destination, and `hand_over` gives mitmproxy a loopback address whose one connection is
spliced to that tunnel. A proxy that cannot be reached, or refuses, fails the connection:
nothing falls back to going out directly. Imports only the stdlib (it runs in mitmdump)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ipaddress
import struct
from dataclasses import dataclass
from typing import Any

DIAL_SECONDS = 15.0
ACCEPT_SECONDS = 30.0  # mitmproxy connects to the handed-over address at once
MAX_HEAD = 16384
CHUNK = 65536
SOCKS_REPLIES = {
    1: "general failure",
    2: "connection not allowed by ruleset",
    3: "network unreachable",
    4: "host unreachable",
    5: "connection refused",
    6: "TTL expired",
    7: "command not supported",
    8: "address type not supported",
}


class UpstreamError(Exception):
    """The upstream proxy could not be reached, or refused the connection."""


@dataclass(frozen=True)
class Upstream:
    scheme: str  # "socks5" or "http"
    host: str
    port: int
    username: str | None = None
    password: str | None = None
    operator: bool = False  # the operator's, for a tenant: its address is not the tenant's

    @classmethod
    def of(cls, data: dict[str, Any] | None) -> Upstream | None:
        if not data:
            return None
        return cls(
            str(data["scheme"]),
            str(data["host"]),
            int(data["port"]),
            data.get("username"),
            data.get("password"),
            bool(data.get("operator")),
        )

    @property
    def address(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"


Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def dial(up: Upstream, proxy_ip: str, dest: str, port: int) -> Stream:
    """A connection through `up` (reached at `proxy_ip`) to `dest`:`port`."""
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(proxy_ip, up.port), DIAL_SECONDS
        )
    except (OSError, TimeoutError) as exc:
        raise UpstreamError(f"cannot reach it: {exc or 'timed out'}") from None
    try:
        handshake = _socks5 if up.scheme == "socks5" else _connect
        await asyncio.wait_for(handshake(reader, writer, up, dest, port), DIAL_SECONDS)
    except (OSError, TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
        writer.close()
        raise UpstreamError(f"broke off: {exc or 'timed out'}") from None
    except UpstreamError:
        writer.close()
        raise
    return reader, writer


async def _socks5(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, up: Upstream, dest: str, port: int
) -> None:
    methods = b"\x00\x02" if up.username is not None else b"\x00"
    writer.write(bytes([5, len(methods)]) + methods)
    version, method = await reader.readexactly(2)
    if version != 5 or method == 0xFF or method not in methods:
        raise UpstreamError("it does not speak SOCKS5 with these credentials")
    if method == 2:
        user = (up.username or "").encode()
        password = (up.password or "").encode()
        writer.write(bytes([1, len(user)]) + user + bytes([len(password)]) + password)
        _, status = await reader.readexactly(2)
        if status != 0:
            raise UpstreamError("it refused the username and password")
    try:
        ip = ipaddress.ip_address(dest)
        target = bytes([1 if ip.version == 4 else 4]) + ip.packed
    except ValueError:
        name = dest.encode("idna")
        target = bytes([3, len(name)]) + name
    writer.write(b"\x05\x01\x00" + target + struct.pack("!H", port))
    version, reply, _, kind = await reader.readexactly(4)
    if version != 5 or reply != 0:
        raise UpstreamError(f"it refused {dest}:{port}: {SOCKS_REPLIES.get(reply, reply)}")
    size = {1: 4, 4: 16}.get(kind)
    if size is None:
        size = (await reader.readexactly(1))[0]
    await reader.readexactly(size + 2)  # the address it bound


async def _connect(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, up: Upstream, dest: str, port: int
) -> None:
    authority = f"[{dest}]:{port}" if ":" in dest else f"{dest}:{port}"
    head = f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n"
    if up.username is not None:
        pair = base64.b64encode(f"{up.username}:{up.password or ''}".encode()).decode()
        head += f"Proxy-Authorization: Basic {pair}\r\n"
    writer.write((head + "\r\n").encode())
    answer = await reader.readuntil(b"\r\n\r\n")
    if len(answer) > MAX_HEAD:
        raise UpstreamError("its answer to CONNECT is too long")
    status = answer.split(b"\r\n", 1)[0].decode("latin-1")
    parts = status.split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or parts[1] != "200":
        raise UpstreamError(f"it refused {authority}: {status}")


class Splicer:
    """Loopback addresses that each take one connection and splice it to a tunnel."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    async def hand_over(self, tunnel: Stream) -> tuple[str, int]:
        up_reader, up_writer = tunnel
        taken = asyncio.Event()

        async def take(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            if taken.is_set():
                writer.close()
                return
            taken.set()
            server.close()
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
            writer.close()
            up_writer.close()

        server = await asyncio.start_server(take, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]

        async def expire() -> None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(taken.wait(), ACCEPT_SECONDS)
            if not taken.is_set():
                server.close()
                up_writer.close()

        task = asyncio.create_task(expire())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return "127.0.0.1", port


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (OSError, ConnectionError):
        pass
    finally:
        with contextlib.suppress(OSError, RuntimeError):
            await writer.drain()
