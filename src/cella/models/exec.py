"""Exec requests, results and streamed events.

Output is bytes in the guest. On the wire it travels as UTF-8 text when it is valid UTF-8 and
as base64 otherwise (`encoding` says which), so nothing is ever lost or mangled.
"""

from __future__ import annotations

import base64
from typing import Literal

from pydantic import BaseModel, Field

Encoding = Literal["utf-8", "base64"]


def encode_data(data: bytes) -> tuple[str, Encoding]:
    try:
        return data.decode("utf-8"), "utf-8"
    except UnicodeDecodeError:
        return base64.b64encode(data).decode("ascii"), "base64"


def encode_pair(out: bytes, err: bytes) -> tuple[str, str, Encoding]:
    """Both streams in one encoding: UTF-8 if both are valid UTF-8, else base64."""
    try:
        return out.decode("utf-8"), err.decode("utf-8"), "utf-8"
    except UnicodeDecodeError:
        b64 = base64.b64encode
        return b64(out).decode("ascii"), b64(err).decode("ascii"), "base64"


def decode_data(text: str, encoding: Encoding) -> bytes:
    return base64.b64decode(text) if encoding == "base64" else text.encode("utf-8")


class ExecRequest(BaseModel):
    model_config = {"extra": "forbid"}

    command: list[str] | str = Field(description="argv, or a string run by /bin/sh -c")
    cwd: str | None = Field(default=None, max_length=4096)
    env: dict[str, str] = Field(default_factory=dict, max_length=1024)
    user: str | None = Field(default=None, max_length=64)
    stdin: str | None = Field(default=None, description="text passed to the command's stdin")
    timeout: float | None = Field(default=None, gt=0, le=86400)


class ExecResult(BaseModel):
    exit_code: int
    signal: int | None = None
    timed_out: bool = False
    duration_ms: float
    stdout: str
    stderr: str
    encoding: Encoding = "utf-8"


class ExecEvent(BaseModel):
    """One line of a streamed exec: started, stdout, stderr, exit or error."""

    type: Literal["started", "stdout", "stderr", "exit", "error"]
    pid: int | None = None
    data: str | None = None
    encoding: Encoding | None = None
    exit_code: int | None = None
    signal: int | None = None
    timed_out: bool | None = None
    duration_ms: float | None = None
    code: str | None = None
    message: str | None = None

    @property
    def bytes(self) -> bytes:
        """The output chunk of a stdout/stderr event as the guest wrote it."""
        if self.data is None:
            return b""
        return decode_data(self.data, self.encoding or "utf-8")
