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
