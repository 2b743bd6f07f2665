"""What routes depend on: the daemon, the caller (`Auth`), and JSON Lines framing."""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import Depends, Header
from starlette.requests import HTTPConnection

from cella import errors
from cella.service.daemon import Daemon
from cella.service.keys import Principal


def daemon(request: HTTPConnection) -> Daemon:
    found: Daemon = request.app.state.daemon
    return found


def principal(
    request: HTTPConnection, authorization: Annotated[str | None, Header()] = None
) -> Principal:
    if not authorization:
        raise errors.Unauthenticated("an API key is required (Authorization: Bearer <key>)")
    scheme, _, key = authorization.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise errors.Unauthenticated("use Authorization: Bearer <key>")
    return daemon(request).keys.authenticate(key.strip())


Auth = Annotated[Principal, Depends(principal)]
Service = Annotated[Daemon, Depends(daemon)]


def jsonl(obj: Any) -> bytes:
    return (json.dumps(obj, separators=(",", ":")) + "\n").encode()
