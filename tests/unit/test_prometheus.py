"""What /metrics counts from events and requests, and a gateway's merge of its nodes'."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from cella.telemetry.prometheus import Exposition, merge


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_events_become_counters_and_histograms() -> None:
    m = Exposition()
    m.observe({"type": "created", "tenant": "t", "data": {"from": "pool", "restore_ms": 40.0}})
    m.observe({"type": "forked", "tenant": "t", "data": {"restore_ms": 60.0}})
    m.observe({"type": "exec", "tenant": "t", "data": {"exit_code": 1, "duration_ms": 5}})
    m.observe({"type": "exec", "tenant": "t", "data": {"exit_code": None, "timed_out": True}})
    m.observe(
        {"type": "egress", "tenant": "t", "data": {"allowed": False, "bytes_in": 0, "bytes_out": 9}}
    )
    got = samples(m.text())
    assert got[("cella_creates_total", (("origin", "pool"), ("tenant", "t")))] == 1
    assert got[("cella_forks_total", (("tenant", "t"),))] == 1
    assert got[("cella_restore_seconds_count", (("kind", "create"),))] == 1
    assert got[("cella_restore_seconds_sum", (("kind", "fork"),))] == 0.06
    assert got[("cella_execs_total", (("outcome", "failed"), ("tenant", "t")))] == 1
    assert got[("cella_execs_total", (("outcome", "timed_out"), ("tenant", "t")))] == 1
    assert got[("cella_egress_decisions_total", (("outcome", "denied"), ("tenant", "t")))] == 1
    assert got[("cella_egress_bytes_total", (("direction", "sent"), ("outcome", "denied")))] == 9
    assert got[("cella_sandbox_events_total", (("type", "exec"),))] == 2


def test_gauges_are_read_at_each_scrape() -> None:
    m = Exposition()
    state = {"running": 1.0}
    m.gauges(lambda: {"cella_sandboxes": ("by state", "state", dict(state))})
    assert samples(m.text())[("cella_sandboxes", (("state", "running"),))] == 1
    state["running"] = 3.0
    assert samples(m.text())[("cella_sandboxes", (("state", "running"),))] == 3


def test_a_gateway_merges_its_nodes_one_family_each() -> None:
    node = Exposition()
    node.observe({"type": "created", "tenant": "t", "data": {"from": "cold"}})
    gateway = Exposition()
    gateway.request("GET", "/v1/health", 200, 0.01)
    node.request("GET", "/v1/health", 200, 0.02)
    merged = merge({"": gateway.text(), "n1": node.text(), "n2": node.text()})
    assert merged.count("# TYPE cella_http_request_seconds histogram") == 1
    got = samples(merged)
    assert got[("cella_creates_total", (("node", "n1"), ("origin", "cold"), ("tenant", "t")))] == 1
    assert got[("cella_creates_total", (("node", "n2"), ("origin", "cold"), ("tenant", "t")))] == 1
    count = "cella_http_request_seconds_count"
    base = (("method", "GET"), ("route", "/v1/health"), ("status", "200"))
    assert got[(count, base)] == 1  # the gateway's own: no node label
    assert got[(count, tuple(sorted((*base, ("node", "n1")))))] == 1
