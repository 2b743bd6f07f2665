"""Who envd's caller acts as, in which sandbox: the sandbox the `E2b-Sandbox-Id` header
names, proved by `X-Access-Token`, and the user the SDK names (`Authorization: Basic`, or
`username=`), `user` by default, whose home relative paths start from. What the SDK makes
belongs to that user."""

from __future__ import annotations

import base64
import binascii
import posixpath
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from cella import errors
from cella.models import SandboxState
from cella.policy.access import Principal
from cella.server.deps import daemon
from cella.service.daemon import Daemon
from cella.store import SandboxRecord

DEFAULT_USER = "user"


@dataclass(frozen=True, slots=True)
class Target:
    svc: Daemon
    who: Principal  # the holder of the sandbox's envd access token (given to its drivers)
    sandbox_id: str
    user: str

    @property
    def home(self) -> str:
        return "/root" if self.user == "root" else f"/home/{self.user}"

    def path(self, given: Any) -> str:
        if not isinstance(given, str) or not given:
            raise errors.InvalidArgument("path is required")
        return posixpath.normpath(posixpath.join(self.home, given))


async def running(
    svc: Daemon, request: Request, prove: Callable[[str], None] | None = None
) -> SandboxRecord:
    """The sandbox the `E2b-Sandbox-Id` header names, running (else "not found", which the
    SDK reads as a sandbox that is not running). One made with `auto_resume` that sleeps is
    woken for a caller that `prove`s its right to it, and the request waits meanwhile."""
    sandbox_id = request.headers.get("e2b-sandbox-id", "")
    try:
        row: SandboxRecord | None = svc.registry.row(sandbox_id)
    except errors.NotFound:
        row = None
    if row is not None and row.state != SandboxState.running and row.auto_resume:
        (prove or (lambda _: None))(row.id)
        row = await svc.waking.on_traffic(row.id)
    if row is None or row.state != SandboxState.running:
        raise errors.AgentUnavailable(f"The sandbox {sandbox_id} was not found")
    return row


async def target(request: Request, username: str | None = None) -> Target:
    svc: Daemon = daemon(request)
    token = request.headers.get("x-access-token", "")
    row = await running(svc, request, lambda sandbox_id: svc.ports.check_access(sandbox_id, token))
    svc.ports.check_access(row.id, token)
    holder = Principal.service(row.tenant)
    return Target(svc, holder, row.id, username or basic_user(request) or DEFAULT_USER)


def basic_user(request: Request) -> str | None:
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        return base64.b64decode(value).decode().partition(":")[0] or None
    except (binascii.Error, UnicodeDecodeError):
        raise errors.InvalidArgument("a Basic authorization that is not base64") from None


async def first_missing(where: Target, path: str) -> str:
    """The topmost directory above `path` that does not exist yet (or `path` itself): what
    a write with parents will create."""
    top = path
    parent = posixpath.dirname(path)
    while parent not in ("/", ""):
        try:
            await where.svc.files.stat(where.who, where.sandbox_id, parent)
            break
        except errors.NotFound:
            top, parent = parent, posixpath.dirname(parent)
    return top


async def own(where: Target, path: str) -> None:
    """What the SDK makes belongs to the user it acts as (files are written as root)."""
    if where.user != "root":
        await where.svc.files.chown(where.who, where.sandbox_id, path, where.user, recursive=True)
