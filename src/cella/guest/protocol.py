"""Wire format between the host and the guest agent (agent/agent.c keeps the same constants).

A frame is a 9-byte header - payload length (u32), channel (u32), type (u8), all big-endian -
followed by the payload. Each request picks a fresh channel; every reply to it carries that
channel, so many execs and transfers share the one virtio-serial port. Request payloads are a
sequence of fields: tag (u8), length (u32), value. The guest is untrusted: the host checks every
length it reads before using it.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from enum import IntEnum

from cella import errors

HEADER = struct.Struct(">IIB")
MAX_FRAME = 1 << 20
CHUNK = 256 << 10
# Output (exec, file read, stream data) a side may have sent and not yet had acknowledged
# (ACK frames): a slow consumer slows the producer instead of filling memory.
WINDOW = 1 << 20
# The guest's network, as the agent sets it up (the VM has no NIC): every name resolves to
# EGRESS_ADDR, a loopback address where the agent listens on EGRESS_PORTS and carries each
# connection to the host as a stream.
EGRESS_ADDR = "10.0.2.100"
EGRESS_PORTS = (80, 443, 3128)  # transparent HTTP, transparent TLS, explicit proxy
PROXY_PORT = 3128
# Channels of streams the guest opens (connections to the egress ports) have this bit set;
# the host's requests use channels below it.
STREAM_BIT = 0x80000000


class Msg(IntEnum):
    # host -> guest
    PING = 0x01
    EXEC = 0x02
    STDIN = 0x03
    KILL = 0x04
    READ = 0x10
    WRITE = 0x11
    WDATA = 0x12
    WEND = 0x13
    LIST = 0x14
    STAT = 0x15
    MKDIR = 0x16
    REMOVE = 0x17
    CHMOD = 0x18
    IDENTITY = 0x19
    SHUTDOWN = 0x1A
    ACK = 0x1B  # u32: bytes of the channel's output taken (also guest -> host: 0x8C)
    SDATA = 0x1C  # stream data; empty: no more from this side
    SCLOSE = 0x1D  # stream closed (also guest -> host: 0x8B)
    CONNECT = 0x1E  # open a stream to a guest port (u32), answered OK or ERROR
    RESIZE = 0x1F  # a terminal exec's size: u32 columns, u32 rows
    POLICY = 0x28  # the exec policy: POL_DEFAULT and POL_RULE fields, answered OK
    # guest -> host
    PONG = 0x81
    STARTED = 0x82
    STDOUT = 0x83
    STDERR = 0x84
    EXIT = 0x85
    DATA = 0x86
    END = 0x87
    OK = 0x88
    SOPEN = 0x89  # the guest opened a stream: u32 destination port
    GSDATA = 0x8A
    GSCLOSE = 0x8B
    GACK = 0x8C
    ERROR = 0x8F
    FSCHANGES = 0x90  # on an exec's channel before its exit: the files it changed
    EXECDENIED = 0x91  # on channel 0: the exec policy refused an execve
    PROCS = 0xA0  # channel 0: process records of traced execs (decode_procs)
    OWNER = 0xA1  # a guest stream's opener, sent before its SOPEN (decode_owner)


class Field(IntEnum):
    ARG = 1
    ENV = 2
    CWD = 3
    USER = 4
    TIMEOUT_MS = 5
    STDIN = 6
    PATH = 7
    MODE = 8
    PARENTS = 9
    RECURSIVE = 10
    HOSTNAME = 11
    TIME_NS = 12
    SEED = 13
    SANDBOX_ID = 15
    PIDS_MAX = 16
    PTY = 17  # columns << 16 | rows: run in a terminal of that size
    XATTR = 18  # key NUL value: metadata set on a written file (`user.e2b.<key>`)
    XATTRS = 19  # stat and list report each entry's metadata after it
    WRAPPER = 30  # exec: argv[0] is the host's own shell for a string command
    EXEMPT = 31  # exec: the host's own upkeep, not held to the exec policy
    POL_DEFAULT = 32  # 1: what no rule matches is denied
    POL_RULE = 33  # action b"a"|b"d", kind b"p" (path glob) | b"h" (sha256 digest), value
    TRACE = 34  # trace the exec's processes (PROCS frames)


class ProtocolError(errors.AgentUnavailable):
    """The guest sent something that does not follow the protocol."""


def frame(channel: int, msg: Msg, payload: bytes = b"") -> bytes:
    if len(payload) > MAX_FRAME:
        raise ValueError(f"frame payload {len(payload)} exceeds {MAX_FRAME}")
    return HEADER.pack(len(payload), channel, msg) + payload


def fields(items: Iterable[tuple[Field, bytes | str | int | bool]]) -> bytes:
    out = bytearray()
    for tag, value in items:
        if isinstance(value, bool):
            raw = b"\x01" if value else b""
        elif isinstance(value, int):
            raw = value.to_bytes(8, "big")
        elif isinstance(value, str):
            raw = value.encode("utf-8", "surrogateescape")
        else:
            raw = value
        out += struct.pack(">BI", tag, len(raw)) + raw
    return bytes(out)


class FrameDecoder:
    """Incremental decoder: feed bytes, get complete frames; refuses oversize frames."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> Iterator[tuple[int, int, bytes]]:
        self._buf += data
        while len(self._buf) >= HEADER.size:
            length, channel, msg = HEADER.unpack_from(self._buf)
            if length > MAX_FRAME:
                raise ProtocolError(f"guest sent a {length}-byte frame (limit {MAX_FRAME})")
            end = HEADER.size + length
            if len(self._buf) < end:
                break
            payload = bytes(self._buf[HEADER.size : end])
            del self._buf[:end]
            yield channel, msg, payload


@dataclass(frozen=True, slots=True)
class Entry:
    """One file system entry as the guest reports it."""

    name: str
    kind: str  # "file", "dir", "symlink", "other"
    mode: int
    size: int
    mtime_ns: int
    uid: int
    gid: int
    target: str | None = None
    metadata: dict[str, str] | None = None  # asked for with XATTRS, when it has any


_KINDS = {ord("f"): "file", ord("d"): "dir", ord("l"): "symlink", ord("o"): "other"}
_ENTRY = struct.Struct(">BIQQII")


def decode_entries(payload: bytes) -> list[Entry]:
    entries: list[Entry] = []
    off = 0
    n = len(payload)
    while off < n:
        if n - off < _ENTRY.size + 2:
            raise ProtocolError("truncated directory entry")
        kind, mode, size, mtime, uid, gid = _ENTRY.unpack_from(payload, off)
        off += _ENTRY.size
        name, off = _short_bytes(payload, off)
        target, off = _short_bytes(payload, off)
        if kind == ord("x"):  # a metadata record of the entry before it
            if not entries:
                raise ProtocolError("metadata before any entry")
            key, value = (b.decode("utf-8", "replace") for b in (name, target))
            last = entries[-1]
            entries[-1] = replace(last, metadata={**(last.metadata or {}), key: value})
            continue
        if kind not in _KINDS:
            raise ProtocolError(f"unknown entry kind {kind}")
        entries.append(
            Entry(
                name=name.decode("utf-8", "surrogateescape"),
                kind=_KINDS[kind],
                mode=mode,
                size=size,
                mtime_ns=mtime,
                uid=uid,
                gid=gid,
                target=target.decode("utf-8", "surrogateescape") if target else None,
            )
        )
    return entries


def _short_bytes(payload: bytes, off: int) -> tuple[bytes, int]:
    if len(payload) - off < 2:
        raise ProtocolError("truncated directory entry")
    (length,) = struct.unpack_from(">H", payload, off)
    off += 2
    if len(payload) - off < length:
        raise ProtocolError("truncated directory entry")
    return payload[off : off + length], off + length


@dataclass(frozen=True, slots=True)
class ExitStatus:
    exit_code: int
    signal: int | None
    timed_out: bool
    # the files the command changed (None: the agent does not report them), and how many
    # changes were left out past the bound
    file_changes: tuple[FileChange, ...] | None = None
    changes_dropped: int = 0


def decode_exit(payload: bytes) -> ExitStatus:
    if len(payload) != 9:
        raise ProtocolError("malformed exit frame")
    code, sig, timed_out = struct.unpack(">IIB", payload)
    return ExitStatus(exit_code=code, signal=sig or None, timed_out=bool(timed_out))


def decode_error(payload: bytes) -> tuple[int, str]:
    if len(payload) < 4:
        raise ProtocolError("malformed error frame")
    (err,) = struct.unpack_from(">I", payload)
    return err, payload[4:1028].decode("utf-8", "replace")


# A command's file changes as the guest reports them (bounded there; the host bounds again).
MAX_FILE_CHANGES = 1000
_CHANGE_KINDS = {
    ord("c"): "created",
    ord("m"): "modified",
    ord("d"): "deleted",
    ord("r"): "renamed",
}
_CHANGE = struct.Struct(">BBQ")


@dataclass(frozen=True, slots=True)
class FileChange:
    path: str
    change: str  # "created", "modified", "deleted", "renamed" (from `source`)
    size: int  # at the end of the command; 0 for directories and deleted paths
    is_dir: bool = False
    source: str | None = None


def decode_file_changes(payload: bytes) -> tuple[int, list[FileChange]]:
    """One FSCHANGES frame: how many changes the guest left out, and the changes."""
    if len(payload) < 4:
        raise ProtocolError("malformed file changes frame")
    (dropped,) = struct.unpack_from(">I", payload)
    off, out = 4, []
    while off < len(payload):
        if len(payload) - off < _CHANGE.size:
            raise ProtocolError("truncated file change")
        kind, is_dir, size = _CHANGE.unpack_from(payload, off)
        path, off = _short_bytes(payload, off + _CHANGE.size)
        source, off = _short_bytes(payload, off)
        if kind not in _CHANGE_KINDS:
            raise ProtocolError(f"unknown file change kind {kind}")
        out.append(
            FileChange(
                path=path.decode("utf-8", "replace"),
                change=_CHANGE_KINDS[kind],
                size=size,
                is_dir=bool(is_dir),
                source=source.decode("utf-8", "replace") if source else None,
            )
        )
    return dropped, out


@dataclass(frozen=True, slots=True)
class ExecDenied:
    """The exec policy refused an execve in the guest."""

    pid: int
    channel: int  # the exec it belongs to (0: none known)
    suppressed: int  # refusals left out before this one (the guest's rate limit)
    sha256: str | None
    path: str
    argv: list[str]  # the calling process's command line (the new one never started)


def decode_exec_denied(payload: bytes) -> ExecDenied:
    if len(payload) < 46:
        raise ProtocolError("malformed exec refusal")
    pid, channel, suppressed = struct.unpack_from(">III", payload)
    digest = payload[12:44]
    path, off = _short_bytes(payload, 44)
    argv, _ = _short_bytes(payload, off)
    return ExecDenied(
        pid=pid,
        channel=channel,
        suppressed=suppressed,
        sha256=digest.hex() if any(digest) else None,
        path=path.decode("utf-8", "replace"),
        argv=[a.decode("utf-8", "replace") for a in argv.split(b"\0") if a][:64],
    )


# -- the process trace (agent/proctrace.c) ------------------------------------------------

ARGV_MAX = 1024  # bytes of a process's argv the guest sends
_PROC = struct.Struct(">IIIIQQIIQ")  # chan pid ppid uid start end code signal cpu_us
_SUMMARY = struct.Struct(">IIIIB")  # chan total recorded dropped lost
NO_CPU = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class ProcRecord:
    """A process of a traced exec (the exec's channel): ended, or still running when the
    exec ended (`end_ms` None). Times are the guest's wall clock in milliseconds."""

    channel: int
    pid: int
    ppid: int
    uid: int
    start_ms: int
    end_ms: int | None
    exit_code: int | None
    signal: int | None
    cpu_ms: float | None
    argv: list[str]
    cwd: str | None


@dataclass(frozen=True, slots=True)
class ProcSummary:
    """Sent once a traced exec and every process it left are gone: how many processes it
    made, how many were recorded (the rest counted only) and whether the kernel dropped
    events (`lost`: the counts are low)."""

    channel: int
    total: int
    recorded: int
    dropped: int
    lost: bool


def _argv(raw: bytes) -> list[str]:
    return [a.decode("utf-8", "replace") for a in raw.split(b"\0")] if raw else []


def decode_procs(payload: bytes) -> list[ProcRecord | ProcSummary]:
    out: list[ProcRecord | ProcSummary] = []
    off, n = 0, len(payload)
    while off < n:
        kind = payload[off]
        off += 1
        if kind == ord("s"):
            if n - off < _SUMMARY.size:
                raise ProtocolError("truncated process summary")
            chan, total, recorded, dropped, lost = _SUMMARY.unpack_from(payload, off)
            off += _SUMMARY.size
            out.append(ProcSummary(chan, total, recorded, dropped, bool(lost)))
            continue
        if kind not in (ord("x"), ord("r")) or n - off < _PROC.size:
            raise ProtocolError("malformed process record")
        chan, pid, ppid, uid, start, end, code, sig, cpu = _PROC.unpack_from(payload, off)
        off += _PROC.size
        argv, off = _short_bytes(payload, off)
        cwd, off = _short_bytes(payload, off)
        if len(argv) > ARGV_MAX or len(cwd) > 4096:
            raise ProtocolError("oversize process record")
        running = kind == ord("r")
        out.append(
            ProcRecord(
                channel=chan,
                pid=pid,
                ppid=ppid,
                uid=uid,
                start_ms=start,
                end_ms=None if running else end,
                exit_code=None if running or sig else code,
                signal=sig or None,
                cpu_ms=None if cpu == NO_CPU else cpu / 1000,
                argv=_argv(argv),
                cwd=cwd.decode("utf-8", "replace") or None,
            )
        )
    return out


@dataclass(frozen=True, slots=True)
class Owner:
    """The guest process that opened a connection, and the traced exec it belongs to
    (the exec's channel; 0: none)."""

    pid: int
    uid: int
    channel: int
    argv: list[str]


def decode_owner(payload: bytes) -> Owner:
    if len(payload) < 12 or len(payload) > 12 + ARGV_MAX:
        raise ProtocolError("malformed owner frame")
    pid, uid, chan = struct.unpack_from(">III", payload)
    return Owner(pid, uid, chan, _argv(payload[12:]))
