"""Sandbox events as OpenTelemetry spans.

Each sandbox is one trace (its id derived from the sandbox id, so every event of it lands in
the same trace even across daemon restarts). An exec is a span over its real start and end;
the processes it started are spans under it (each under its parent process's span), and a
connection is a span over its duration under the process that opened it; other events are
instants. Span ids of execs and processes come from the sandbox, the exec's event id and the
pid, so a child finds its parent's span without the daemon remembering it. Attributes carry
the sandbox id, the command, exit code, paths, digests and egress decisions; lineage (parent
sandbox, snapshot) is on the creating span.
"""

from __future__ import annotations

import hashlib
import json
import threading
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
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

SCALARS = (str, bool, int, float)


def trace_ids(sandbox_id: str) -> tuple[int, int]:
    """(trace id, root span id) of a sandbox: stable, so its spans always group together."""
    digest = hashlib.sha256(f"cella-sandbox:{sandbox_id}".encode()).digest()
    return int.from_bytes(digest[:16], "big"), int.from_bytes(digest[16:24], "big")


def span_id(sandbox_id: str, exec_id: int, pid: int | None = None) -> int:
    """The span of an exec (its event id) or of one of its processes (`pid`)."""
    key = f"cella-span:{sandbox_id}:{exec_id}:{'' if pid is None else pid}"
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") or 1


class _ChosenIds(IdGenerator):
    """Random ids, except a span id chosen for the span being started (per thread)."""

    def __init__(self) -> None:
        self._random = RandomIdGenerator()
        self.next = threading.local()

    def generate_span_id(self) -> int:
        chosen = getattr(self.next, "span_id", None)
        self.next.span_id = None
        return chosen or self._random.generate_span_id()

    def generate_trace_id(self) -> int:
        return self._random.generate_trace_id()


def placement(event: dict[str, Any]) -> tuple[int | None, int | None, int, int]:
    """(the event's own span id, its parent span id (None: the sandbox's root), start,
    end in ns): where an exec, a process or a connection sits in the sandbox's trace."""
    sandbox, data, kind = event["sandbox_id"], event["data"], event["type"]
    end = _ns(event["at"])
    start = end
    own: int | None = None
    parent: int | None = None
    exec_id = data.get("exec")
    if kind == "exec":
        own = span_id(sandbox, event["id"])
        if data.get("started_at"):
            start = _ns(data["started_at"])
            end = _ns(data.get("ended_at") or event["at"])
    elif kind in ("process", "process_summary") and isinstance(exec_id, int):
        parent = span_id(sandbox, exec_id)
        if kind == "process":
            own = span_id(sandbox, exec_id, data.get("pid"))
            ppid = data.get("ppid")
            if isinstance(ppid, int) and ppid > 1:  # 1: the agent, which started the command
                parent = span_id(sandbox, exec_id, ppid)
            if data.get("started_at"):
                start = _ns(data["started_at"])
                end = _ns(data.get("ended_at") or data["started_at"])
    elif kind == "egress" and isinstance(data.get("process"), dict):
        who = data["process"]
        if isinstance(who.get("exec"), int):
            parent = span_id(sandbox, who["exec"], who.get("pid"))
        if isinstance(data.get("duration_ms"), int | float):
            start = end - int(data["duration_ms"] * 1e6)
    return own, parent, start, end


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
    if event["type"] == "process":
        argv = data.get("argv") or []
        return f"process {' '.join(str(a) for a in argv)[:80]}"
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
        elif key == "process" and isinstance(value, dict):  # a connection's opener
            attrs |= {f"cella.process.{k}": v for k, v in value.items() if _attribute_value(v)}
        elif _attribute_value(value):
            attrs[f"cella.{key}"] = value
    if event["type"] == "process":
        attrs["process.pid"] = data.get("pid")
        attrs["process.parent_pid"] = data.get("ppid")
        attrs["process.command_args"] = [str(a) for a in data.get("argv") or []]
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
        self._ids = _ChosenIds()
        self.provider = TracerProvider(
            resource=Resource.create(
                {"service.name": "cella", "service.version": version("cella")}
            ),
            id_generator=self._ids,
        )
        processor = (
            BatchSpanProcessor(exporter, schedule_delay_millis=500)
            if batch
            else SimpleSpanProcessor(exporter)
        )
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer("cella.sandbox")

    def __call__(self, event: dict[str, Any]) -> None:
        if event["type"] == "process" and event["data"].get("state") == "running":
            return  # its span is made when it ends (it is reported again then)
        trace_id, root = trace_ids(event["sandbox_id"])
        own, above, start, end = placement(event)
        parent = NonRecordingSpan(
            SpanContext(
                trace_id, above or root, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED)
            )
        )
        self._ids.next.span_id = own
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
