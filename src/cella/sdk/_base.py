"""What the sync and async SDK share, with no I/O: configuration, errors, request bodies.

`ExecResult` is `cella.models.ExecResult`, the same type the daemon sends."""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path
from typing import Any

import httpx2

from cella import errors
from cella.config import ADMIN_KEY_FILE, ClientSettings
from cella.models import (
    AwsSigning,
    CallbackRule,
    GcpToken,
    HeaderRule,
    IdentityToken,
    RewriteRule,
    UpstreamProxy,
    encode_data,
)

DEFAULT_TIMEOUT = 300.0  # seconds a request may take (a command's: see `command_wait`)
# An idle pooled connection is dropped after this long: sooner than the daemon closes its
# end (uvicorn: 5 s). Were both 5 s, a request sent on a connection just as the daemon closes
# it would never be read, and the caller could not know whether its create happened.
IDLE_REUSE_SECONDS = 2.0
CONNECT_TIMEOUT = 10.0
COMMAND_MARGIN = 60.0  # beyond a command's own timeout: the daemon's and the network's share


def client_timeout(timeout: float) -> httpx2.Timeout:
    return httpx2.Timeout(timeout, connect=CONNECT_TIMEOUT)


def command_wait(timeout: float, command_timeout: float | None) -> httpx2.Timeout:
    """How long a request that runs a command waits for its answer: as long as the command
    may run and a margin (a command without a timeout: no limit), never less than the
    client's `timeout`."""
    read = None if command_timeout is None else max(timeout, command_timeout + COMMAND_MARGIN)
    return httpx2.Timeout(timeout, connect=CONNECT_TIMEOUT, read=read)


def resolve(url: str | list[str] | None, api_key: str | None) -> tuple[str, str]:
    """The daemon's URL and the API key to use: the arguments, else `CELLA_URL` and
    `CELLA_API_KEY`, else the local daemon's `daemon.json` and `admin.key` in `CELLA_DATA_DIR`
    (default /var/lib/cella). See `cella.config`."""
    settings = ClientSettings()
    key = api_key or settings.key()
    if not key:
        raise errors.Unauthenticated(
            "no API key: pass api_key, set CELLA_API_KEY, or run where the daemon's "
            f"{settings.data_dir / ADMIN_KEY_FILE} is readable (set CELLA_DATA_DIR if the "
            "daemon uses another data directory)"
        )
    if isinstance(url, list):
        url = ",".join(url)
    return url.rstrip("/") if url else settings.daemon_url(), key


def raise_for(status: int, body: bytes) -> None:
    """Turns an error response into the matching typed exception."""
    if status < 400:
        return
    try:
        err = json.loads(body)["error"]
        code, message = str(err["code"]), str(err["message"])
    except (ValueError, KeyError, TypeError):
        code, message = "internal", body[:500].decode(errors="replace") or f"HTTP {status}"
    cls = errors.ALL_ERRORS.get(code, errors.CellaError)
    raise cls(message)


def exec_body(
    command: list[str] | str,
    cwd: str | None,
    env: dict[str, str] | None,
    user: str | None,
    stdin: str | bytes | None,
    timeout: float | None,
) -> dict[str, Any]:
    body: dict[str, Any] = {"command": command}
    if cwd is not None:
        body["cwd"] = cwd
    if env:
        body["env"] = env
    if user is not None:
        body["user"] = user
    if isinstance(stdin, bytes):
        body["stdin"], body["stdin_encoding"] = encode_data(stdin)
    elif stdin is not None:
        body["stdin"] = stdin
    if timeout is not None:
        body["timeout"] = timeout
    return body


def idempotency(key: str | None) -> dict[str, str]:
    """The `Idempotency-Key` header of a create, fork or snapshot (none without a key)."""
    return {"Idempotency-Key": key} if key is not None else {}


def create_body(**kwargs: Any) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if v is not None}


def network_body(
    allow: list[str] | None,
    deny: list[str] | None,
    headers: list[HeaderRule] | None,
    aws: list[AwsSigning] | None = None,
    gcp: list[GcpToken] | None = None,
    env: dict[str, str] | None = None,
    callbacks: list[CallbackRule] | None = None,
    rewrites: list[RewriteRule] | None = None,
    *,
    identity_tokens: dict[str, IdentityToken] | None = None,
    upstream_proxy: UpstreamProxy | None = None,
    port_host: str | None = None,
) -> dict[str, Any]:
    """Egress rules as the daemon takes them (it validates them, and says what is wrong)."""
    extra: dict[str, Any] = {}
    if identity_tokens:
        extra["identity_tokens"] = {k: v.model_dump() for k, v in identity_tokens.items()}
    if upstream_proxy is not None:
        extra["upstream_proxy"] = upstream_proxy.model_dump(exclude_none=True)
    if port_host is not None:
        extra["port_host"] = port_host
    return extra | {
        "allow": allow or [],
        "deny": deny or [],
        "headers": [h.model_dump() for h in headers or []],
        "aws": [rule.model_dump() for rule in aws or []],
        "gcp": [rule.model_dump() for rule in gcp or []],
        "env": env or {},
        "callbacks": [c.model_dump() for c in callbacks or []],
        "rewrites": [r.model_dump() for r in rewrites or []],
    }


def tar_directory(path: str | os.PathLike[str]) -> bytes:
    """A build context: the directory as an uncompressed tar, names relative to it."""
    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"{root}: not a directory")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for item in sorted(root.iterdir()):
            tar.add(item, arcname=item.name)
    return buf.getvalue()


# methods that do the same when sent twice: a retry after a reset cannot do it twice
IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE"})


def split_urls(url: str | list[str]) -> list[str]:
    """Several gateways' URLs, from a list or a comma-separated string (`CELLA_URL`)."""
    items = url if isinstance(url, list) else url.split(",")
    urls = [u.strip().rstrip("/") for u in items if u.strip()]
    if not urls:
        raise ValueError("no URL given")
    return urls


def retryable(request: httpx2.Request, exc: httpx2.TransportError) -> bool:
    """Whether a request that failed with `exc` may go to another gateway: one that never
    reached this one (refused, unreachable), or one that a reset cut off that is safe to
    repeat (an idempotent method, or sent with an Idempotency-Key); its body must be one
    that can be sent again (not a stream already consumed)."""
    try:
        request.content  # noqa: B018 (raises for a streamed body)
    except httpx2.RequestNotRead:
        return False
    if isinstance(exc, httpx2.ConnectError | httpx2.ConnectTimeout):
        return True
    if not isinstance(exc, httpx2.ReadError | httpx2.WriteError | httpx2.RemoteProtocolError):
        return False
    return request.method in IDEMPOTENT_METHODS or "idempotency-key" in request.headers
