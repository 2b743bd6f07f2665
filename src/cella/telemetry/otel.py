"""Sandbox events as OpenTelemetry spans.

Each sandbox is one trace (its id derived from the sandbox id, so every event of it lands in
the same trace even across daemon restarts). An exec is a span over its real start and end;
other events are instants. Attributes carry the sandbox id, the command, exit code, paths,
digests and egress decisions; lineage (parent sandbox, snapshot) is on the creating span.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime
from importlib.metadata import version
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

SCALARS = (str, bool, int, float)


def trace_ids(sandbox_id: str) -> tuple[int, int]:
    """(trace id, root span id) of a sandbox: stable, so its spans always group together."""
    digest = hashlib.sha256(f"cella-sandbox:{sandbox_id}".encode()).digest()
    return int.from_bytes(digest[:16], "big"), int.from_bytes(digest[16:24], "big")


def _ns(iso: str) -> int:
    return int(datetime.fromisoformat(iso).timestamp() * 1e9)


def span_name(event: dict[str, Any]) -> str:
    data = event["data"]
    if event["type"] == "exec":
        command = data.get("command")
        text = command if isinstance(command, str) else " ".join(command or [])
        return f"exec {text[:80]}"
    if event["type"] == "egress":
        verdict = "allow" if data.get("allowed") else "deny"
        return f"egress {verdict} {data.get('host')}:{data.get('port')}"
    if "path" in data:
        return f"{event['type']} {data['path']}"
    return str(event["type"])


def attributes(event: dict[str, Any]) -> dict[str, Any]:
    data = event["data"]
    attrs: dict[str, Any] = {
        "cella.sandbox_id": event["sandbox_id"],
        "cella.event.id": event["id"],
        "cella.event.type": event["type"],
    }
    for key, value in data.items():
        if key == "command":
            text = value if isinstance(value, str) else json.dumps(value)
            attrs["cella.command"] = text
            attrs["process.command_line"] = text
        elif key == "exit_code" and value is not None:
            attrs["cella.exit_code"] = value
            attrs["process.exit.code"] = value
        elif _attribute_value(value):
            attrs[f"cella.{key}"] = value
    return attrs


def _attribute_value(value: Any) -> bool:
    """What OpenTelemetry takes as an attribute: a scalar or a list of strings."""
    if isinstance(value, list):
        return all(isinstance(v, str) for v in value)
    return isinstance(value, SCALARS)


class SpanSink:
    """An EventLog sink. `exporter`: any OpenTelemetry SpanExporter (OTLP over HTTP from
    `otlp_http`, or the SDK's in-memory exporter in tests)."""

    def __init__(self, exporter: SpanExporter, *, batch: bool = True) -> None:
        self.provider = TracerProvider(
            resource=Resource.create({"service.name": "cella", "service.version": version("cella")})
        )
        processor = (
            BatchSpanProcessor(exporter, schedule_delay_millis=500)
            if batch
            else SimpleSpanProcessor(exporter)
        )
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer("cella.sandbox")

    def __call__(self, event: dict[str, Any]) -> None:
        trace_id, root = trace_ids(event["sandbox_id"])
        parent = NonRecordingSpan(
            SpanContext(trace_id, root, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))
        )
        end = _ns(event["at"])
        start = end
        if event["type"] == "exec" and event["data"].get("started_at"):
            start = _ns(event["data"]["started_at"])
            end = _ns(event["data"].get("ended_at") or event["at"])
        span = self.tracer.start_span(
            span_name(event),
            context=trace.set_span_in_context(parent),
            start_time=start,
            attributes=attributes(event),
        )
        if event["type"] == "exec" and event["data"].get("exit_code") not in (0, None):
            span.set_status(trace.Status(trace.StatusCode.ERROR, "non-zero exit"))
        span.end(end_time=max(start, end))

    def flush(self) -> None:
        self.provider.force_flush()

    def close(self) -> None:
        self.provider.shutdown()


def otlp_http(endpoint: str) -> SpanExporter:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=endpoint)
