import pytest

from cella.guest.protocol import (
    MAX_FRAME,
    Field,
    FrameDecoder,
    Msg,
    ProtocolError,
    decode_entries,
    decode_exit,
    fields,
    frame,
)


def test_frames_split_anywhere_decode_whole() -> None:
    data = frame(7, Msg.STDOUT, b"hello") + frame(8, Msg.EXIT, bytes(9))
    decoder = FrameDecoder()
    got = []
    for i in range(len(data)):  # one byte at a time
        got += list(decoder.feed(data[i : i + 1]))
    assert got == [(7, Msg.STDOUT, b"hello"), (8, Msg.EXIT, bytes(9))]


def test_oversize_frame_from_guest_is_refused() -> None:
    header = (MAX_FRAME + 1).to_bytes(4, "big") + (1).to_bytes(4, "big") + bytes([Msg.DATA])
    with pytest.raises(ProtocolError):
        list(FrameDecoder().feed(header))


def test_host_refuses_to_build_oversize_frames() -> None:
    with pytest.raises(ValueError, match=f"exceeds {MAX_FRAME}"):
        frame(1, Msg.WDATA, bytes(MAX_FRAME + 1))


def test_fields_encoding() -> None:
    raw = fields([(Field.ARG, "ls"), (Field.TIMEOUT_MS, 5), (Field.STDIN, True)])
    assert raw == (
        bytes([Field.ARG])
        + (2).to_bytes(4, "big")
        + b"ls"
        + bytes([Field.TIMEOUT_MS])
        + (8).to_bytes(4, "big")
        + (5).to_bytes(8, "big")
        + bytes([Field.STDIN])
        + (1).to_bytes(4, "big")
        + b"\x01"
    )


def test_surrogate_escaped_strings_keep_their_bytes() -> None:
    raw = fields([(Field.ARG, b"\xff".decode("utf-8", "surrogateescape"))])
    assert raw.endswith(b"\xff")


def test_truncated_entries_are_protocol_errors() -> None:
    with pytest.raises(ProtocolError):
        decode_entries(b"f" + bytes(10))


def test_entry_roundtrip() -> None:
    import struct

    name = b"a.txt"
    payload = struct.pack(">BIQQII", ord("f"), 0o644, 12, 5, 0, 0)
    payload += struct.pack(">H", len(name)) + name + struct.pack(">H", 0)
    (entry,) = decode_entries(payload)
    assert (entry.name, entry.kind, entry.mode, entry.size, entry.target) == (
        "a.txt",
        "file",
        0o644,
        12,
        None,
    )


def _record(kind: str, name: bytes, target: bytes = b"") -> bytes:
    import struct

    head = struct.pack(">BIQQII", ord(kind), 0o644, 3, 5, 0, 0)
    return head + struct.pack(">H", len(name)) + name + struct.pack(">H", len(target)) + target


def test_metadata_records_belong_to_the_entry_before_them() -> None:
    payload = (
        _record("f", b"a.txt")
        + _record("x", b"content-type", b"text/plain")
        + _record("x", b"owner", b"red")
        + _record("f", b"b.txt")
    )
    a, b = decode_entries(payload)
    assert a.metadata == {"content-type": "text/plain", "owner": "red"}
    assert b.name == "b.txt" and b.metadata is None  # the control: one without any
    with pytest.raises(ProtocolError):  # metadata of no entry
        decode_entries(_record("x", b"k", b"v") + _record("f", b"a.txt"))


def test_exit_frame() -> None:
    status = decode_exit((137).to_bytes(4, "big") + (9).to_bytes(4, "big") + b"\x01")
    assert (status.exit_code, status.signal, status.timed_out) == (137, 9, True)
    with pytest.raises(ProtocolError):
        decode_exit(b"\x00")
