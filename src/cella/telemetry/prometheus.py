"""What a daemon (or a fleet's gateway) counts for Prometheus, in its text format at /metrics.

Counters and histograms are fed from two places that already see everything: the event log
(every create, restore, fork, snapshot, exec and egress decision is an event; `observe`
is one of its sinks) and the API's middleware (every request's route, status, time and
error code). Gauges (sandboxes by state, pool and spare depth, host capacity) are read when
scraped from a function the daemon gives. Labels stay bounded: route templates, not paths;
tenants (which an operator creates), never sandbox ids.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

# seconds: a restore here is tens of ms; a cold boot under TCG several seconds
LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Gauges read at scrape time: name -> (help, {label values: value}) with one label each
Gauges = Mapping[str, tuple[str, str, Mapping[str, float]]]


class Exposition:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.creates = Counter(
            "cella_creates",
            "Sandboxes created, by tenant and origin.",
            ["tenant", "origin"],
            registry=r,
        )
        self.forks = Counter("cella_forks", "Sandboxes forked, by tenant.", ["tenant"], registry=r)
        self.snapshots = Counter(
            "cella_snapshots", "Snapshots taken, by tenant.", ["tenant"], registry=r
        )
        self.restore = Histogram(
            "cella_restore_seconds",
            "Time a new sandbox's VM took to start (restore or boot), by kind.",
            ["kind"],
            buckets=LATENCY,
            registry=r,
        )
        self.execs = Counter(
            "cella_execs", "Commands run, by tenant and outcome.", ["tenant", "outcome"], registry=r
        )
        self.exec_seconds = Histogram(
            "cella_exec_seconds", "Commands' wall time.", buckets=LATENCY, registry=r
        )
        self.egress = Counter(
            "cella_egress_decisions",
            "Egress decisions of the proxy, by tenant and outcome.",
            ["tenant", "outcome"],
            registry=r,
        )
        self.egress_bytes = Counter(
            "cella_egress_bytes",
            "Bytes through the egress proxy, by direction and outcome.",
            ["direction", "outcome"],
            registry=r,
        )
        self.events = Counter(
            "cella_sandbox_events", "Sandbox events, by type.", ["type"], registry=r
        )
        self.requests = Histogram(
            "cella_http_request_seconds",
            "API requests, by method, route template and status.",
            ["method", "route", "status"],
            buckets=LATENCY,
            registry=r,
        )
        self.errors = Counter(
            "cella_api_errors", "Error answers of the API, by error code.", ["code"], registry=r
        )

    def gauges(self, read: Callable[[], Gauges]) -> None:
        """Exposes what `read` returns at each scrape."""
        self.registry.register(_Gauges(read))

    def observe(self, event: Mapping[str, Any]) -> None:
        """An event log sink."""
        kind = str(event.get("type", ""))
        data: Mapping[str, Any] = event.get("data") or {}
        tenant = str(event.get("tenant") or "")
        self.events.labels(kind).inc()
        if kind == "created":
            self.creates.labels(tenant, str(data.get("from", ""))).inc()
            self._restore("create", data)
        elif kind == "forked":
            self.forks.labels(tenant).inc()
            self._restore("fork", data)
        elif kind == "snapshot":
            self.snapshots.labels(tenant).inc()
        elif kind == "exec":
            self.execs.labels(tenant, _exec_outcome(data)).inc()
            if isinstance(data.get("duration_ms"), int | float):
                self.exec_seconds.observe(data["duration_ms"] / 1000)
        elif kind == "egress":
            outcome = "allowed" if data.get("allowed") else "denied"
            self.egress.labels(tenant, outcome).inc()
            for direction, key in (("sent", "bytes_out"), ("received", "bytes_in")):
                if isinstance(data.get(key), int):
                    self.egress_bytes.labels(direction, outcome).inc(data[key])

    def _restore(self, kind: str, data: Mapping[str, Any]) -> None:
        if isinstance(data.get("restore_ms"), int | float) and data["restore_ms"] > 0:
            self.restore.labels(kind).observe(data["restore_ms"] / 1000)

    def request(self, method: str, route: str, status: int, seconds: float) -> None:
        self.requests.labels(method, route, str(status)).observe(seconds)

    def error(self, code: str) -> None:
        self.errors.labels(code).inc()

    def text(self) -> str:
        return generate_latest(self.registry).decode()


def _exec_outcome(data: Mapping[str, Any]) -> str:
    if data.get("timed_out"):
        return "timed_out"
    code = data.get("exit_code")
    if code is None:
        return "lost"
    return "ok" if code == 0 else "failed"


class _Gauges(Collector):
    def __init__(self, read: Callable[[], Gauges]) -> None:
        self._read = read

    def describe(self) -> Iterable[Metric]:
        return []  # read at each scrape: what exists is only known then

    def collect(self) -> Iterator[Metric]:
        for name, (help_, label, values) in self._read().items():
            family = GaugeMetricFamily(name, help_, labels=[label] if label else [])
            for value_of_label, value in values.items():
                family.add_metric([value_of_label] if label else [], value)
            yield family


def merge(texts: Mapping[str, str], label: str = "node") -> str:
    """Several processes' /metrics as one, each sample labelled `label="<key>"` (a key of ""
    adds none): a fleet gateway's own with its nodes'. Families of the same name are one."""
    families: dict[str, Metric] = {}
    for value, text in texts.items():
        for family in text_string_to_metric_families(text):
            into = families.get(family.name)
            if into is None:
                into = Metric(family.name, family.documentation, family.type, family.unit)
                families[family.name] = into
            for sample in family.samples:
                labels = {**sample.labels, label: value} if value else dict(sample.labels)
                into.samples.append(sample._replace(labels=labels))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(list(families.values())))
    return generate_latest(registry).decode()


class _Fixed(Collector):
    def __init__(self, metrics: list[Metric]) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        return iter(self._metrics)
