"""Event redaction and the event -> span mapping (the SDK's in-memory exporter)."""

from __future__ import annotations

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from cella.telemetry.events import redact
from cella.telemetry.otel import SpanSink, trace_ids


def test_redact_nested_values_longest_first() -> None:
    pairs = sorted(
        [("tok-123456", "[secret:a]"), ("tok-123456-extra", "[secret:b]")], key=lambda p: -len(p[0])
    )
    data = {"command": ["curl", "-H", "X: tok-123456-extra"], "out": "tok-123456!", "n": 3}
    assert redact(data, pairs) == {
        "command": ["curl", "-H", "X: [secret:b]"],
        "out": "[secret:a]!",
        "n": 3,
    }


def test_exec_event_becomes_a_span_over_its_run() -> None:
    exporter = InMemorySpanExporter()
    sink = SpanSink(exporter, batch=False)
    sink(
        {
            "id": 7,
            "sandbox_id": "sb-1",
            "type": "exec",
            "at": "2026-01-01T00:00:02+00:00",
            "data": {
                "command": ["pytest", "-q"],
                "exit_code": 1,
                "started_at": "2026-01-01T00:00:00+00:00",
                "ended_at": "2026-01-01T00:00:02+00:00",
                "stdout_bytes": 10,
            },
        }
    )
    sink({"id": 8, "sandbox_id": "sb-1", "type": "deleted", "at": "2026-01-01T00:00:03+00:00",
          "data": {}})  # fmt: skip
    spans = exporter.get_finished_spans()
    exec_span, deleted = spans
    assert exec_span.name == "exec pytest -q"
    assert exec_span.attributes is not None
    assert exec_span.attributes["cella.sandbox_id"] == "sb-1"
    assert exec_span.attributes["cella.exit_code"] == 1
    assert exec_span.attributes["cella.command"] == '["pytest", "-q"]'
    assert exec_span.end_time - exec_span.start_time == 2_000_000_000  # type: ignore[operator]
    assert not exec_span.status.is_ok
    trace_id, root = trace_ids("sb-1")
    assert exec_span.context.trace_id == deleted.context.trace_id == trace_id
    assert exec_span.parent is not None and exec_span.parent.span_id == root


def test_processes_nest_under_their_exec_and_connections_under_their_process() -> None:
    exporter = InMemorySpanExporter()
    sink = SpanSink(exporter, batch=False)
    at = "2026-01-01T00:00:0{}+00:00".format
    exec_event = {"command": "make", "exit_code": 0, "started_at": at(0), "ended_at": at(4)}
    sink({"id": 7, "sandbox_id": "sb-1", "type": "exec", "at": at(4), "data": exec_event})

    def process(event_id: int, pid: int, ppid: int, state: str = "exited") -> None:
        data = {
            "exec": 7,
            "parent": {"exec": 7, "pid": ppid},
            "pid": pid,
            "ppid": ppid,
            "argv": ["cc", "-c"],
            "state": state,
            "started_at": at(1),
            "ended_at": at(3),
        }
        sink({"id": event_id, "sandbox_id": "sb-1", "type": "process", "at": at(4), "data": data})

    process(8, 40, 1)  # the command's own process (its parent is the agent)
    process(9, 41, 40)
    process(10, 42, 40, state="running")  # no span until it ends
    connection = {
        "host": "pypi.test",
        "port": 443,
        "allowed": True,
        "duration_ms": 500,
        "process": {"pid": 41, "argv": ["cc"], "uid": 0, "exec": 7},
    }
    sink({"id": 11, "sandbox_id": "sb-1", "type": "egress", "at": at(3), "data": connection})
    exec_span, root_proc, child, conn = exporter.get_finished_spans()
    assert root_proc.parent is not None and root_proc.parent.span_id == exec_span.context.span_id
    assert child.parent is not None and child.parent.span_id == root_proc.context.span_id
    assert child.name == "process cc -c" and child.attributes is not None
    assert child.attributes["process.pid"] == 41 and child.attributes["process.parent_pid"] == 40
    assert conn.parent is not None and conn.parent.span_id == child.context.span_id
    assert conn.end_time - conn.start_time == 500_000_000  # type: ignore[operator]
    assert conn.attributes is not None and conn.attributes["cella.process.pid"] == 41
