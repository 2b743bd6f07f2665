"""The process trace's host side: the guest's records decoded (and refused when malformed),
held under their exec until its event is written, bounded, and put together as trees."""

from __future__ import annotations

import struct
from datetime import UTC, datetime
from typing import Any

import pytest

from cella.guest.protocol import (
    ProcRecord,
    ProcSummary,
    ProtocolError,
    decode_owner,
    decode_procs,
)
from cella.models import Event
from cella.models.proctree import exec_trees
from cella.service.proctrace import ProcessTrace

START = 1_700_000_000_000


def record(
    kind: bytes,
    chan: int,
    pid: int,
    ppid: int,
    argv: list[str],
    code: int = 0,
    sig: int = 0,
    end: int = START + 5,
    cwd: str = "/w",
) -> bytes:
    raw = b"\0".join(a.encode() for a in argv)
    fixed = struct.pack(">IIIIQQIIQ", chan, pid, ppid, 0, START, end, code, sig, 2500)
    return (
        kind
        + fixed
        + struct.pack(">H", len(raw))
        + raw
        + struct.pack(">H", len(cwd))
        + cwd.encode()
    )


def test_records_decode() -> None:
    payload = record(b"x", 3, 10, 1, ["sh", "-c", "x"], code=2)
    payload += record(b"r", 3, 11, 10, ["sleep", "9"])
    payload += record(b"x", 3, 12, 10, ["yes"], code=137, sig=9)
    payload += b"s" + struct.pack(">IIIIB", 3, 5000, 2000, 3000, 0)
    done, running, killed, summary = decode_procs(payload)
    assert isinstance(done, ProcRecord) and done.argv == ["sh", "-c", "x"]
    assert (done.exit_code, done.signal, done.cpu_ms, done.cwd) == (2, None, 2.5, "/w")
    assert isinstance(running, ProcRecord) and running.end_ms is None
    assert running.exit_code is None
    assert isinstance(killed, ProcRecord) and (killed.exit_code, killed.signal) == (None, 9)
    assert summary == ProcSummary(3, 5000, 2000, 3000, False)


@pytest.mark.parametrize(
    "payload",
    [
        b"q",
        b"x" + b"\0" * 10,
        record(b"x", 1, 2, 1, ["a"])[:-3],
        b"s\0\0",
        b"x" + b"\0" * 48 + b"\xff\xff",
    ],
)
def test_malformed_records_are_refused(payload: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_procs(payload)


def test_owner_frames() -> None:
    owner = decode_owner(struct.pack(">III", 42, 1000, 3) + b"curl\0-s\0http://x")
    assert (owner.pid, owner.uid, owner.channel, owner.argv) == (
        42,
        1000,
        3,
        ["curl", "-s", "http://x"],
    )
    with pytest.raises(ProtocolError):
        decode_owner(b"\0" * 11)
    with pytest.raises(ProtocolError):
        decode_owner(b"\0" * (12 + 1025))


class Events:
    def __init__(self) -> None:
        self.rows: list[tuple[str, str, dict[str, Any]]] = []

    def emit(self, sandbox_id: str, type_: str, data: dict[str, Any] | None = None) -> int:
        self.rows.append((sandbox_id, type_, data or {}))
        return len(self.rows)


def test_records_wait_for_their_exec_and_are_bounded() -> None:
    events = Events()
    procs = ProcessTrace(events, limit=2)  # type: ignore[arg-type]
    agent = type("Agent", (), {"on_procs": None})()
    procs.watch("sb", agent)
    first = decode_procs(record(b"x", 5, 10, 1, ["make"]))
    agent.on_procs(first)  # before the exec's start reached its caller
    procs.started("sb", 5)
    assert events.rows == []
    exec_id = events.emit("sb", "exec", {})
    procs.ended("sb", 5, exec_id)
    (_, kind, data) = events.rows[1]
    assert kind == "process" and data["exec"] == exec_id and data["parent"] == {"exec": 1, "pid": 1}
    # afterwards, records come straight through, up to twice the limit plus a summary
    for pid in range(20, 30):
        agent.on_procs(decode_procs(record(b"x", 5, pid, 10, ["cc"])))
    assert len(events.rows) == 1 + 2 * 2 + 1


def event(id_: int, type_: str, data: dict[str, Any]) -> Event:
    return Event(id=id_, sandbox_id="sb", type=type_, at=datetime.now(UTC), data=data)


def test_trees_put_each_process_under_its_parent() -> None:
    def proc(
        pid: int, ppid: int, argv: list[str], start: str, state: str = "exited"
    ) -> dict[str, Any]:
        return {
            "exec": 1,
            "parent": {"exec": 1, "pid": ppid},
            "pid": pid,
            "ppid": ppid,
            "argv": argv,
            "state": state,
            "started_at": f"2026-01-01T00:00:0{start}+00:00",
        }

    events = [
        event(1, "exec", {"command": "sh -c x", "exit_code": 0}),
        event(2, "process", proc(10, 1, ["sh"], "0")),
        event(3, "process", proc(11, 10, ["sleep"], "1", "running")),
        event(4, "process", proc(12, 10, ["sh", "-c", "y"], "2")),
        event(5, "process", proc(13, 12, ["cat"], "3")),
        event(6, "process", proc(11, 10, ["sleep"], "1")),  # the same sleep, exited
        event(7, "process_summary", {"exec": 1, "total": 4, "truncated": False}),
        event(8, "exec", {"command": "untraced"}),
        event(9, "egress", {"host": "h", "process": {"pid": 13, "exec": 1}}),
        event(10, "egress", {"host": "g", "process": {"pid": 99, "exec": 1}}),
    ]
    (tree,) = exec_trees(events)
    (root,) = tree.processes
    assert [n.pid for n in root.children] == [11, 12]
    assert root.children[0].state == "exited"
    assert [n.pid for n in root.children[1].children] == [13]
    assert [c["host"] for c in root.children[1].children[0].connections] == ["h"]
    assert [c["host"] for c in tree.connections] == ["g"]  # of no process it knows
    assert [n.pid for n in tree.walk()] == [10, 11, 12, 13]
    assert tree.summary == {"total": 4, "truncated": False}
