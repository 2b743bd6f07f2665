"""Operating a daemon, on real microVMs: /metrics scraped by a real Prometheus server
(Debian's `prometheus`): a PromQL query returns the creates and execs the test made, per
tenant, and the same server scraping without the admin key gets nothing (the control); log
lines as JSON with the request's id and sandbox; the version the daemon reports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest

import cella
from cella import Client, errors
from tests.daemon import Daemon, free_port

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.vm,
    pytest.mark.skipif(shutil.which("prometheus") is None, reason="needs Debian's prometheus"),
]


@pytest.fixture(scope="module")
def daemon_settings() -> dict[str, str]:
    return {"pool_size": "0", "log_format": "json"}


@pytest.fixture(scope="module")
def prometheus(daemon: Daemon, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("prometheus")
    target = daemon.url.removeprefix("http://")
    (root / "prometheus.yml").write_text(
        textwrap.dedent(
            f"""
            global: {{scrape_interval: 1s, scrape_timeout: 1s}}
            scrape_configs:
              - job_name: cella
                authorization: {{credentials_file: {daemon.data_dir / "admin.key"}}}
                static_configs: [{{targets: ["{target}"]}}]
              - job_name: nokey
                static_configs: [{{targets: ["{target}"]}}]
            """
        )
    )
    port = free_port()
    proc = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={root / 'prometheus.yml'}",
            f"--storage.tsdb.path={root / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=(root / "prometheus.log").open("wb"),
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _until(lambda: httpx2.get(f"{url}/-/ready", timeout=2).status_code == 200, 60)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def _until(check: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return
        except httpx2.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError("not in time")
        time.sleep(0.5)


def _query(url: str, promql: str) -> dict[str, float]:
    """The instant vector of `promql`, keyed by its labels."""
    answer = httpx2.get(f"{url}/api/v1/query", params={"query": promql}, timeout=10).json()
    assert answer["status"] == "success", answer
    return {
        ",".join(f"{k}={v}" for k, v in sorted(r["metric"].items()) if k != "__name__"): float(
            r["value"][1]
        )
        for r in answer["data"]["result"]
    }


def test_prometheus_scrapes_the_creates_and_execs_it_made(
    daemon: Daemon, admin: Client, prometheus: str
) -> None:
    key = admin.create_key("metered")["key"]
    with daemon.client(key) as team:
        boxes = [team.create(), team.create()]
        try:
            assert boxes[0].exec("exit 3").exit_code == 3
            assert boxes[1].exec("true").exit_code == 0
        finally:
            for box in boxes:
                box.delete()
    want = {"": 2.0}
    _until(lambda: _query(prometheus, 'sum(cella_creates_total{tenant="metered"})') == want, 60)
    execs = _query(prometheus, 'sum by (outcome) (cella_execs_total{tenant="metered"})')
    assert execs == {"outcome=failed": 1.0, "outcome=ok": 1.0}
    assert _query(prometheus, "sum(cella_restore_seconds_count)")[""] >= 2
    routes = _query(prometheus, 'cella_http_request_seconds_count{route="/v1/sandboxes"}')
    assert any("method=POST" in labels and "status=201" in labels for labels in routes), routes
    # every series the shipped dashboard draws is one the daemon exposes
    dashboard = json.loads((ROOT / "docs/operations/grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    drawn = {m for e in exprs for m in re.findall(r"cella_[a-z_]+", e)}
    exposed = admin.request("GET", "/metrics").text
    named = {line.split()[0].split("{")[0] for line in exposed.splitlines() if line[:1] != "#"}
    named |= {line.split()[2] for line in exposed.splitlines() if line.startswith("# TYPE")}
    assert drawn and drawn <= named, drawn - named
    # the control: the same server, the same target, no key (once both were scraped)
    instance = "instance=" + daemon.url.removeprefix("http://")
    jobs = [f"{instance},job=cella", f"{instance},job=nokey"]
    _until(lambda: all(j in _query(prometheus, "up") for j in jobs), 60)
    up = _query(prometheus, "up")
    assert up[jobs[0]] == 1.0
    assert up[jobs[1]] == 0.0


def test_metrics_are_for_admin_keys_and_name_gauges(daemon: Daemon, admin: Client) -> None:
    key = admin.create_key("nosy")["key"]
    with daemon.client(key) as tenant, pytest.raises(errors.PermissionDenied):
        tenant.request("GET", "/metrics")
    text = admin.request("GET", "/metrics").text
    for name in ("cella_sandboxes", "cella_host_vcpus", "cella_host_memory_mib"):
        assert f"# TYPE {name} gauge" in text
    assert 'cella_host_vcpus{kind="limit"}' in text
    # an error answer is counted by its code
    with pytest.raises(errors.NotFound):
        admin.get("sb-does-not-exist")
    after = admin.request("GET", "/metrics").text
    assert 'cella_api_errors_total{code="not_found"}' in after


def test_log_lines_are_json_with_the_request_and_its_sandbox(daemon: Daemon, admin: Client) -> None:
    box = admin.create()
    try:
        answer = admin.request(
            "GET", f"/v1/sandboxes/{box.id}", headers={"X-Request-Id": "req-logs-1"}
        )
        assert answer.headers["x-request-id"] == "req-logs-1"
        fresh = admin.request("GET", "/v1/health").headers["x-request-id"]
        assert fresh and fresh != "req-logs-1"  # one of its own when none is given
    finally:
        box.delete()
    lines = [
        json.loads(line) for line in daemon.log.read_text().splitlines() if line.startswith("{")
    ]
    assert lines, "no JSON log lines"
    assert all({"time", "level", "logger", "message"} <= line.keys() for line in lines)
    mine = [line for line in lines if line.get("request_id") == "req-logs-1"]
    assert mine, "the request's access log line carries its id"
    assert all(line["sandbox_id"] == box.id for line in mine)
    # the control: a line about another request names no such id
    assert any(line.get("request_id") not in (None, "req-logs-1") for line in lines)


def test_the_daemon_reports_its_version(admin: Client) -> None:
    health = admin.request("GET", "/v1/health").json()
    assert health["version"] == cella.__version__
    out = subprocess.run(
        [sys.executable, "-m", "cella.cli", "--version"], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == f"cella {cella.__version__}"
