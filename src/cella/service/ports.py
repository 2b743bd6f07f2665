"""Ports: reaching servers that run inside a sandbox.

A connection to a guest port is a stream over the agent channel (`open`), used as is by
port forwarding and tunnels. A service URL lets a browser or an HTTP client reach a guest
port without an API key: it carries a short-lived token, signed with this daemon's key
(`DATA_DIR/service.key`), naming the sandbox, the port and when it expires. `http` forwards
one HTTP request over a fresh stream and returns the guest server's response as it streams;
`guest_path` is the path a guest server is asked for, the same one the daemon checked.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import time
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import h11

from cella import errors
from cella.guest.client import GuestStream
from cella.policy.access import Permission, Principal
from cella.service.registry import Registry

MAX_TOKEN_SECONDS = 86400
DEFAULT_MOUNT_TOKEN_SECONDS = 3600
# The code interpreter of `code-interpreter` sandboxes: it runs code for whoever reaches
# it, so besides an API key or a service token minted for it, only the sandbox's access
# token (the one E2B's `/execute` takes) opens it.
INTERPRETER_PORT = 49999
PATH_SAFE = "!$&'()*+,;=:@"  # a path segment's characters that stay as they are
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "host",
    }
)


@dataclass(frozen=True, slots=True)
class ServiceToken:
    token: str
    sandbox_id: str
    port: int
    tenant: str
    expires_at: float


@dataclass(slots=True)
class HttpResponse:
    status: int
    reason: str
    headers: list[tuple[str, str]]
    body: AsyncIterator[bytes]


class Ports:
    def __init__(self, registry: Registry, key_file: Path) -> None:
        self.registry = registry
        self._key = load_key(key_file)
        self.mount_token_seconds = DEFAULT_MOUNT_TOKEN_SECONDS

    async def open(self, who: Principal, sandbox_id: str, port: int) -> GuestStream:
        """A connection to `port` on the sandbox's loopback; `PortClosed` when nothing
        listens there."""
        if not 1 <= port <= 65535:
            raise errors.InvalidArgument(f"port must be 1-65535, got {port}")
        _, vm = self.registry.live(who, sandbox_id)
        try:
            return await vm.agent.open_port(port)
        except errors.GuestError as exc:  # the guest's connect() failed
            raise errors.PortClosed(f"nothing answers on port {port}: {exc.message}") from None

    # -- service tokens -----------------------------------------------------------------

    def mint(self, who: Principal, sandbox_id: str, port: int, seconds: int) -> ServiceToken:
        """A token that opens the port for whoever holds it (a caller who may exec)."""
        tenant = self.registry.get(who, sandbox_id, Permission.exec).tenant
        if not 1 <= port <= 65535:
            raise errors.InvalidArgument(f"port must be 1-65535, got {port}")
        if not 1 <= seconds <= MAX_TOKEN_SECONDS:
            raise errors.InvalidArgument(f"expiry must be 1-{MAX_TOKEN_SECONDS} seconds")
        expires = int(time.time()) + seconds
        claims = {"s": sandbox_id, "p": port, "t": tenant, "e": expires}
        body = _b64(json.dumps(claims, separators=(",", ":")).encode())
        token = f"{body}.{_b64(self._sign(body))}"
        return ServiceToken(token, sandbox_id, port, tenant, expires)

    def verify(self, token: str, sandbox_id: str, port: int) -> ServiceToken:
        """The token's claims, if it is ours, unexpired, and for this sandbox and port."""
        body, _, signature = token.partition(".")
        try:
            good = hmac.compare_digest(_unb64(signature), self._sign(body))
            claims = json.loads(_unb64(body)) if good else {}
        except ValueError:
            claims = {}
        if not claims or (claims.get("s"), claims.get("p")) != (sandbox_id, port):
            raise errors.PermissionDenied("the service token is not valid for this port")
        if claims["e"] < time.time():
            raise errors.PermissionDenied("the service token has expired")
        return ServiceToken(token, sandbox_id, port, str(claims["t"]), float(claims["e"]))

    def access_token(self, sandbox_id: str) -> str:
        """A bearer for one sandbox's own endpoints (E2B's envd `X-Access-Token`), valid as
        long as the sandbox lives."""
        return _b64(self._sign(f"access:{sandbox_id}"))

    def check_access(self, sandbox_id: str, token: str) -> None:
        if not hmac.compare_digest(token.encode(), self.access_token(sandbox_id).encode()):
            raise errors.Unauthenticated("the sandbox access token is not valid")

    def traffic_token(self, sandbox_id: str) -> str:
        """A bearer for the servers of a sandbox whose ports are not public (E2B's
        `trafficAccessToken`), valid as long as the sandbox lives."""
        return _b64(self._sign(f"traffic:{sandbox_id}"))

    def check_traffic(self, sandbox_id: str, token: str) -> None:
        if not hmac.compare_digest(token.encode(), self.traffic_token(sandbox_id).encode()):
            raise errors.PermissionDenied("this sandbox's ports need its traffic access token")

    def rewrite_token(self, sandbox_id: str) -> str:
        """The egress proxy's bearer for one sandbox's rewrite rules (the daemon checks the
        rules themselves on every request)."""
        return _b64(self._sign(f"rewrite:{sandbox_id}"))

    def check_rewrite(self, sandbox_id: str, token: str) -> None:
        if not hmac.compare_digest(token.encode(), self.rewrite_token(sandbox_id).encode()):
            raise errors.PermissionDenied("not the egress proxy's rewrite token")

    def volume_token(self, volume_id: str) -> str:
        """A bearer for one volume's content API (E2B's volume token), valid as long as the
        volume lives."""
        return _b64(self._sign(f"volume:{volume_id}"))

    def mount_token(self, sandbox_id: str, expires: int | None = None) -> str:
        """The egress proxy's bearer for one sandbox's volume mounts, until `expires` (by
        default `mount_token_seconds` from now; `service.mount_renewal` gives the proxy a
        new one before then). The daemon checks the mounts themselves on every request."""
        if expires is None:
            expires = int(time.time() + self.mount_token_seconds)
        return f"{expires}.{_b64(self._sign(f'volume-mounts:{sandbox_id}:{expires}'))}"

    def check_mount_token(self, sandbox_id: str, token: str) -> None:
        """`PermissionDenied` unless `token` is this sandbox's mount token and unexpired."""
        expires = token.partition(".")[0]
        if not expires.isdigit() or not self.same(
            token, self.mount_token(sandbox_id, int(expires))
        ):
            raise errors.PermissionDenied("not the egress proxy's volume token")
        if int(expires) < time.time():
            raise errors.PermissionDenied("the volume mount token has expired")

    @staticmethod
    def same(given: str, expected: str) -> bool:
        return hmac.compare_digest(given.encode(), expected.encode())

    def host_caller(
        self, sandbox_id: str, port: int, *, access: str, traffic: str, service_token: str
    ) -> Principal:
        """Whom a request to a port by host name acts for: anyone's, when the
        sandbox's ports are public; else only with its traffic token (E2B's) or a service
        token. The code interpreter's port takes the sandbox's access token, public or not."""
        row = self.registry.store.get_sandbox(sandbox_id)
        if row is None:
            raise errors.NotFound(f"no sandbox {sandbox_id}")
        if port == INTERPRETER_PORT:
            self.check_access(row.id, access)
        elif not row.network.public_ports:
            if traffic:
                self.check_traffic(row.id, traffic)
            else:
                self.verify(service_token, sandbox_id, port)
        return Principal.service(row.tenant)  # the token (or a public port) lets it in

    def _sign(self, body: str) -> bytes:
        return hmac.new(self._key, body.encode(), hashlib.sha256).digest()

    # -- HTTP to a guest server ----------------------------------------------------------

    async def http(
        self,
        who: Principal,
        sandbox_id: str,
        port: int,
        method: str,
        target: str,
        headers: list[tuple[str, str]],
        body: AsyncIterable[bytes],
        host: str | None = None,
    ) -> HttpResponse:
        """One HTTP/1.1 request to the guest server on `port` (its `Host` the one the
        sandbox's network policy names, by default the port's loopback address, or
        `host`); the response streams."""
        stream = await self.open(who, sandbox_id, port)
        if host is None:
            host = self.registry.get(who, sandbox_id).network.host_for(port)
        conn = h11.Connection(h11.CLIENT)
        sent = [(k, v) for k, v in headers if k.lower() not in HOP_BY_HOP]
        sent += [("host", host), ("connection", "close")]
        if not any(k.lower() == "content-length" for k, _ in sent):
            sent.append(("transfer-encoding", "chunked"))  # a body of unknown length
        try:
            await stream.write(conn.send(h11.Request(method=method, target=target, headers=sent)))
            async for chunk in body:
                if chunk:
                    await stream.write(conn.send(h11.Data(data=chunk)))
            await stream.write(conn.send(h11.EndOfMessage()))
            event = await _next_event(conn, stream)
            if not isinstance(event, h11.Response):
                raise errors.GuestError("the server in the sandbox sent no HTTP response")
        except (h11.ProtocolError, ConnectionError) as exc:
            await stream.close()
            raise errors.GuestError(f"the server in the sandbox broke HTTP: {exc}") from None
        response_headers = [(k.decode(), v.decode("latin-1")) for k, v in event.headers]
        return HttpResponse(
            event.status_code,
            event.reason.decode("latin-1"),
            [(k, v) for k, v in response_headers if k.lower() not in HOP_BY_HOP],
            _body(conn, stream),
        )


def guest_path(path: str) -> str:
    """The path a guest server is sent for `path` as the daemon's routes matched it
    (percent-decoded): dot segments resolved and empty segments dropped, then encoded
    again. So the guest is asked for the route that was checked: `..`, `%2e%2e`, `//` and
    an encoded `/` (already a separator to the route) cannot name another one, and a
    decoded `?` or `#` stays part of the path."""
    kept: list[str] = []
    segments = path.split("/")
    for segment in segments:
        if segment == "..":
            if kept:
                kept.pop()
        elif segment not in ("", "."):
            kept.append(quote(segment, safe=PATH_SAFE))
    directory = segments[-1] in ("", ".", "..")  # `a/`, `a/.` and `a/b/..` name a directory
    return "/" + "/".join(kept) + ("/" if kept and directory else "")


async def _next_event(conn: h11.Connection, stream: GuestStream) -> object:
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await stream.read())
            continue
        if isinstance(event, h11.InformationalResponse):
            continue
        return event


async def _body(conn: h11.Connection, stream: GuestStream) -> AsyncIterator[bytes]:
    try:
        while True:
            event = await _next_event(conn, stream)
            if isinstance(event, h11.Data):
                yield bytes(event.data)
            else:  # end of message, or the server closed the connection
                return
    except h11.ProtocolError:
        return
    finally:
        await stream.close()


def load_key(path: Path) -> bytes:
    """A daemon's signing key: read from `path`, made (32 random bytes, 0600) if absent."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        key = os.urandom(32)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key)
        return key


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
