"""Exec requests, results and streamed events, and the one output collector.

Output is bytes in the guest. On the wire it travels as UTF-8 text when it is valid UTF-8 and
as base64 otherwise (`encoding` says which), so nothing is ever lost or mangled. The same
`ExecResult` is what the guest client returns, what the API sends and what the SDK hands
back; `OutputCollector` is how every one of them gathers output.
"""

from __future__ import annotations

import base64
import hashlib
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    Field,
    WithJsonSchema,
    field_serializer,
    field_validator,
    model_validator,
)

from cella import errors

Encoding = Literal["utf-8", "base64"]
# Largest command (argv or shell string, in bytes) an exec may carry: the guest agent's
# frames bound what it accepts, and a bigger one is a mistake better refused up front.
MAX_COMMAND_BYTES = 256 << 10
# Tail of the output kept in an exec's trace event (the caller got all of it).
TRACE_TAIL = 2048


def encode_data(data: bytes) -> tuple[str, Encoding]:
    try:
        return data.decode("utf-8"), "utf-8"
    except UnicodeDecodeError:
        return base64.b64encode(data).decode("ascii"), "base64"


def decode_data(text: str, encoding: Encoding) -> bytes:
    return base64.b64decode(text) if encoding == "base64" else text.encode("utf-8")


class ExecRequest(BaseModel):
    model_config = {"extra": "forbid"}

    command: list[str] | str = Field(description="argv, or a string run by /bin/sh -c")
    cwd: str | None = Field(default=None, min_length=1, max_length=4096)
    env: dict[str, str] = Field(default_factory=dict, max_length=1024)
    user: str | None = Field(default=None, min_length=1, max_length=64)
    stdin: str | None = Field(
        default=None, description="data for the command's stdin, in `stdin_encoding`"
    )
    stdin_encoding: Encoding = Field(default="utf-8", description="utf-8 text or base64")
    timeout: float | None = Field(default=None, gt=0, le=86400)

    @field_validator("command")
    @classmethod
    def _command(cls, value: list[str] | str) -> list[str] | str:
        parts = [value] if isinstance(value, str) else value
        if not parts or (isinstance(value, str) and not value.strip()):
            raise ValueError("command must not be empty")
        if any("\x00" in p for p in parts):
            raise ValueError("command must not contain NUL bytes")
        size = sum(len(p.encode()) for p in parts)
        if size > MAX_COMMAND_BYTES:
            raise ValueError(f"command is {size} bytes; at most {MAX_COMMAND_BYTES} are allowed")
        return value

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        for key, item in value.items():
            if not key or "=" in key or "\x00" in key or "\x00" in item:
                raise ValueError(f"invalid environment variable {key!r}")
        return value

    @model_validator(mode="after")
    def _stdin(self) -> ExecRequest:
        if self.stdin is not None and self.stdin_encoding == "base64":
            try:
                base64.b64decode(self.stdin, validate=True)
            except ValueError:
                raise ValueError("stdin is not valid base64") from None
        return self

    @property
    def stdin_bytes(self) -> bytes | None:
        return None if self.stdin is None else decode_data(self.stdin, self.stdin_encoding)

    def agent_kwargs(self) -> dict[str, Any]:
        """The guest agent's exec arguments (environment added by the caller)."""
        return {
            "cwd": self.cwd,
            "env": dict(self.env),
            "user": self.user,
            "stdin": self.stdin_bytes,
            "timeout": self.timeout,
        }


WireBytes = Annotated[
    bytes, WithJsonSchema({"type": "string", "description": "text, or base64 (see encoding)"})
]


class ExecResult(BaseModel):
    """A finished command. A non-zero exit is data, unless `check()` is asked for."""

    exit_code: int
    signal: int | None = None
    timed_out: bool = False
    duration_ms: float = 0.0
    stdout: WireBytes = b""
    stderr: WireBytes = b""
    encoding: Encoding = Field(
        default="utf-8", description="how stdout and stderr travel: UTF-8 text or base64"
    )
    stdout_truncated: int = Field(default=0, description="bytes of stdout not kept")
    stderr_truncated: int = Field(default=0, description="bytes of stderr not kept")

    @model_validator(mode="before")
    @classmethod
    def _from_wire(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(isinstance(data.get(k), str) for k in OUTPUTS):
            data = dict(data)
            encoding = data.pop("encoding", "utf-8")  # bytes from here on: it has done its job
            for key in OUTPUTS:
                if isinstance(data.get(key), str):
                    data[key] = decode_data(data[key], encoding)
        return data

    def _wire_encoding(self) -> Encoding:
        """UTF-8 when both streams are valid UTF-8, else base64 for both."""
        try:
            self.stdout.decode("utf-8")
            self.stderr.decode("utf-8")
        except UnicodeDecodeError:
            return "base64"
        return "utf-8"

    @field_serializer("stdout", "stderr", when_used="json")
    def _text(self, value: bytes) -> str:
        if self._wire_encoding() == "utf-8":
            return value.decode("utf-8")
        return base64.b64encode(value).decode("ascii")

    @field_serializer("encoding", when_used="json")
    def _encoding(self, value: Encoding) -> Encoding:
        return self._wire_encoding()

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    @property
    def text(self) -> str:
        return self.stdout.decode("utf-8", "replace")

    @property
    def truncated(self) -> bool:
        return bool(self.stdout_truncated or self.stderr_truncated)

    def check(self, command: object) -> ExecResult:
        """Raises `CommandFailed` unless the command exited 0 in time."""
        if not self.ok:
            why = "timed out" if self.timed_out else f"exited with {self.exit_code}"
            tail = self.stderr.decode("utf-8", "replace")[-500:]
            raise errors.CommandFailed(f"{command!r} {why}: {tail}")
        return self


OUTPUTS = ("stdout", "stderr")


class OutputCollector:
    """Gathers a command's output as it streams: sizes, a SHA-256 of all of it, a bounded
    tail (for the trace) and, up to `keep` bytes per stream, the output itself (for a
    result; what is over is counted, not kept)."""

    def __init__(self, keep: int | None = None) -> None:
        self.keep = keep
        self.sizes = {"stdout": 0, "stderr": 0}
        self.kept = {"stdout": bytearray(), "stderr": bytearray()}
        self.digest = hashlib.sha256()
        self.tail = bytearray()

    def add(self, stream: str, data: bytes) -> None:
        self.sizes[stream] += len(data)
        self.digest.update(data)
        self.tail.extend(data)
        del self.tail[:-TRACE_TAIL]
        kept = self.kept[stream]
        room = len(data) if self.keep is None else max(0, self.keep - len(kept))
        kept.extend(data[:room])

    def result(
        self, exit_code: int, signal: int | None, timed_out: bool, duration_ms: float
    ) -> ExecResult:
        out, err = self.kept["stdout"], self.kept["stderr"]
        return ExecResult(
            exit_code=exit_code,
            signal=signal,
            timed_out=timed_out,
            duration_ms=round(duration_ms, 2),
            stdout=bytes(out),
            stderr=bytes(err),
            stdout_truncated=self.sizes["stdout"] - len(out),
            stderr_truncated=self.sizes["stderr"] - len(err),
        )

    def trace(self) -> dict[str, Any]:
        """What an exec's trace event records of its output."""
        return {
            "stdout_bytes": self.sizes["stdout"],
            "stderr_bytes": self.sizes["stderr"],
            "output_sha256": self.digest.hexdigest(),
            "output_tail": self.tail.decode("utf-8", "replace"),
        }


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


class ProcessSummary(BaseModel):
    """A command that outlives its connection (e.g. the image's entrypoint): its state and
    how much of its output is kept (the latest bytes, at most 4 MiB per stream, fewer when
    the sandbox's or tenant's processes keep more than the daemon allows)."""

    id: str
    command: list[str] | str
    running: bool
    exit_code: int | None = None
    signal: int | None = None
    stdout_bytes: int = Field(default=0, description="bytes of stdout kept")
    stderr_bytes: int = Field(default=0, description="bytes of stderr kept")


class ProcessInfo(ProcessSummary):
    """A process with the output kept of it."""

    stdout: str = ""
    stderr: str = ""


class ProcessList(BaseModel):
    """The sandbox's processes, without their output (read one for that)."""

    processes: list[ProcessSummary]
