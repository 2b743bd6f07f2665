"""Request validation happens once, in the models; results travel without loss."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from cella.models import (
    ChmodRequest,
    ExecRequest,
    ExecResult,
    MkdirRequest,
    OutputCollector,
    SandboxCreate,
)
from cella.models.exec import MAX_COMMAND_BYTES


@pytest.mark.parametrize(
    ("command", "why"),
    [
        ([], "empty"),
        ("", "empty"),
        ("   ", "empty"),
        (["a\x00b"], "NUL"),
        ("x" * (MAX_COMMAND_BYTES + 1), "at most"),
        (["y"] * (MAX_COMMAND_BYTES // 1 + 1), "at most"),
    ],
)
def test_bad_commands_are_refused(command: object, why: str) -> None:
    with pytest.raises(ValidationError, match=why):
        ExecRequest(command=command)  # type: ignore[arg-type]


def test_stdin_bytes_round_trip_as_base64() -> None:
    raw = bytes(range(256))
    from cella.sdk._base import exec_body

    body = exec_body("cat", None, None, None, raw, None)
    assert body["stdin_encoding"] == "base64"
    assert ExecRequest.model_validate(body).stdin_bytes == raw
    assert ExecRequest(command="cat", stdin="héllo").stdin_bytes == "héllo".encode()
    with pytest.raises(ValidationError, match="base64"):
        ExecRequest(command="cat", stdin="***", stdin_encoding="base64")
    with pytest.raises(ValidationError, match="environment"):
        ExecRequest(command="env", env={"A=B": "c"})


@pytest.mark.parametrize(("out", "err"), [(b"ok\n", b""), (b"\xff\xfe", b"text"), (b"", b"\x00")])
def test_exec_results_travel_as_text_or_base64_without_loss(out: bytes, err: bytes) -> None:
    result = ExecResult(exit_code=3, stdout=out, stderr=err, stdout_truncated=7)
    wire = result.model_dump(mode="json")
    assert isinstance(wire["stdout"], str)
    assert wire["encoding"] == ("utf-8" if out == b"ok\n" or err == b"\x00" else "base64")
    assert ExecResult.model_validate(wire) == result


def test_the_collector_keeps_a_bounded_part_and_counts_the_rest() -> None:
    output = OutputCollector(keep=4)
    for chunk in (b"abc", b"defg", b"hi"):
        output.add("stdout", chunk)
    output.add("stderr", b"E" * 3000)
    result = output.result(0, None, False, 12.345)
    assert (result.stdout, result.stdout_truncated) == (b"abcd", 5)
    assert (len(result.stderr), result.stderr_truncated) == (4, 2996)
    assert result.truncated and result.duration_ms == 12.35
    trace = output.trace()
    assert trace["stdout_bytes"] == 9 and trace["stderr_bytes"] == 3000
    assert len(trace["output_tail"]) == 2048
    assert OutputCollector().result(0, None, False, 0).stdout == b""


def test_paths_are_absolute_normalised_and_nul_free() -> None:
    assert MkdirRequest(path="/a/./b/../c//d").path == "/a/c/d"
    for bad, why in (("relative", "absolute"), ("", "at least 1"), ("/a\x00b", "NUL")):
        with pytest.raises(ValidationError, match=why):
            ChmodRequest(path=bad, mode=0o644)


def test_labels_are_checked_once() -> None:
    assert SandboxCreate(labels={"task.id/x-1": "v"}).labels == {"task.id/x-1": "v"}
    for labels, why in (
        ({"": "v"}, "invalid label key"),
        ({"bad key": "v"}, "invalid label key"),
        ({"k": "v" * 256}, "longer than 255"),
        ({"x" * 64: "v"}, "invalid label key"),
    ):
        with pytest.raises(ValidationError, match=why):
            SandboxCreate(labels=labels)
