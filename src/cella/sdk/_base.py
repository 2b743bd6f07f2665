"""What the sync and async SDK share, with no I/O: configuration, errors, results."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cella import errors
from cella.models import ExecResult as WireExecResult
from cella.models import decode_data
from cella.paths import DEFAULT_DATA_DIR
from cella.server.settings import DEFAULT_LISTEN

DEFAULT_TIMEOUT = 300.0


def resolve(url: str | None, api_key: str | None) -> tuple[str, str]:
    """`CELLA_URL` and `CELLA_API_KEY`, else the local daemon's address and admin key file."""
    url = url or os.environ.get("CELLA_URL")
    api_key = api_key or os.environ.get("CELLA_API_KEY")
    if url is None:
        try:
            url = json.loads((DEFAULT_DATA_DIR / "daemon.json").read_text())["url"]
        except (OSError, ValueError, KeyError):
            url = f"http://{DEFAULT_LISTEN}"
    if api_key is None:
        key_file = Path(DEFAULT_DATA_DIR / "admin.key")
        try:
            api_key = key_file.read_text().strip()
        except OSError:
            raise errors.Unauthenticated(
                "no API key: set CELLA_API_KEY (or run on the daemon's host as root)"
            ) from None
    return url.rstrip("/"), api_key


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


@dataclass(frozen=True, slots=True)
class ExecResult:
    """A finished command. A non-zero exit is data, unless `check=True` was asked for."""

    exit_code: int
    stdout: bytes
    stderr: bytes
    signal: int | None = None
    timed_out: bool = False
    duration_ms: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    @property
    def text(self) -> str:
        return self.stdout.decode("utf-8", "replace")

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> ExecResult:
        wire = WireExecResult.model_validate(data)
        return cls(
            exit_code=wire.exit_code,
            stdout=decode_data(wire.stdout, wire.encoding),
            stderr=decode_data(wire.stderr, wire.encoding),
            signal=wire.signal,
            timed_out=wire.timed_out,
            duration_ms=wire.duration_ms,
        )

    def check(self, command: object) -> ExecResult:
        if not self.ok:
            why = "timed out" if self.timed_out else f"exited with {self.exit_code}"
            tail = self.stderr.decode("utf-8", "replace")[-500:]
            raise errors.CommandFailed(f"{command!r} {why}: {tail}")
        return self


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
    if stdin is not None:
        body["stdin"] = stdin.decode() if isinstance(stdin, bytes) else stdin
    if timeout is not None:
        body["timeout"] = timeout
    return body


def create_body(**kwargs: Any) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if v is not None}
