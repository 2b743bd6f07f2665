"""The file changes and exec refusals the guest reports, and the exec policy's model: bad
input from either side is refused clearly."""

from __future__ import annotations

import struct

import pytest
from pydantic import ValidationError

from cella.guest.protocol import (
    FileChange,
    ProtocolError,
    decode_exec_denied,
    decode_file_changes,
)
from cella.models import ExecPolicy


def change(kind: bytes, path: bytes, size: int = 0, is_dir: int = 0, source: bytes = b"") -> bytes:
    return (
        kind
        + bytes([is_dir])
        + struct.pack(">Q", size)
        + struct.pack(">H", len(path))
        + path
        + struct.pack(">H", len(source))
        + source
    )


def test_file_changes_decode_and_refuse_garbage() -> None:
    frame = struct.pack(">I", 3) + change(b"c", b"/a", 5) + change(b"r", b"/b", 2, 0, b"/c")
    dropped, changes = decode_file_changes(frame + change(b"d", b"/d", 0, 1))
    assert dropped == 3
    assert changes == [
        FileChange("/a", "created", 5),
        FileChange("/b", "renamed", 2, source="/c"),
        FileChange("/d", "deleted", 0, is_dir=True),
    ]
    with pytest.raises(ProtocolError):
        decode_file_changes(frame[:-1])  # cut short
    with pytest.raises(ProtocolError):
        decode_file_changes(struct.pack(">I", 0) + change(b"x", b"/a"))
    with pytest.raises(ProtocolError):
        decode_file_changes(b"\0\0")


def test_exec_refusal_decodes() -> None:
    digest = bytes(range(32))
    body = struct.pack(">III", 42, 7, 1) + digest
    body += struct.pack(">H", 13) + b"/usr/bin/curl" + struct.pack(">H", 9) + b"sh\0-c\0ls\0"
    denied = decode_exec_denied(body)
    assert (denied.pid, denied.channel, denied.suppressed) == (42, 7, 1)
    assert denied.sha256 == digest.hex() and denied.path == "/usr/bin/curl"
    assert denied.argv == ["sh", "-c", "ls"]
    unhashed = decode_exec_denied(struct.pack(">III", 1, 0, 0) + bytes(32) + b"\0\0\0\0")
    assert unhashed.sha256 is None and unhashed.argv == []
    with pytest.raises(ProtocolError):
        decode_exec_denied(body[:40])


def test_exec_policy_model() -> None:
    policy = ExecPolicy.model_validate(
        {"default": "deny", "rules": [{"sha256": "AB" * 32, "action": "allow"}]}
    )
    assert policy.rules[0].sha256 == "ab" * 32 and not policy.inert
    assert ExecPolicy().inert
    for bad in (
        {"rules": [{"action": "deny"}]},  # names nothing
        {"rules": [{"path_glob": "/x", "sha256": "a" * 64, "action": "deny"}]},  # both
        {"rules": [{"sha256": "xyz", "action": "deny"}]},
        {"rules": [{"path_glob": "/x", "action": "maybe"}]},
        {"default": "sometimes"},
        {"rules": [{"path_glob": "/x", "action": "deny"}] * 257},
    ):
        with pytest.raises(ValidationError):
            ExecPolicy.model_validate(bad)
