"""Metrics samples and logs through the real app (fake runtime): cella's
`/v1/sandboxes/{id}/metrics` and E2B's shapes of the same, a guest's word on its memory
bounded by what it was given, the bounded history, and E2B's log filters and pages."""

from __future__ import annotations

from pathlib import Path

import httpx2

from tests.unit.in_process import InProcess, serving

MEMINFO = b"MemTotal: 500000 kB\nMemFree: 1000 kB\nMemAvailable: 300000 kB\nCached: 1024 kB\n"
LIES = b"MemTotal: 999999999 kB\nMemAvailable: 0 kB\nCached: 999999999 kB\n"


def e2b_client(app: InProcess) -> httpx2.AsyncClient:
    transport = httpx2.ASGITransport(app=app.app)
    head = {"X-API-KEY": app.admin_key}
    return httpx2.AsyncClient(transport=transport, base_url="http://cella.test", headers=head)


async def test_samples_and_their_shapes(tmp_path: Path) -> None:
    async with (
        serving(tmp_path, metrics_keep=3) as app,
        app.client() as client,
        e2b_client(app) as e2b,
    ):
        sandbox = await client.create()
        vm = app.vm(sandbox.id)
        vm.agent.files["/proc/meminfo"] = MEMINFO
        metrics = app.daemon.metrics
        await metrics.sample_all()  # the first only marks where CPU time starts
        assert await sandbox.metrics() == []
        for _ in range(4):
            await metrics.sample_all()
        got = await sandbox.metrics()
        one = (await e2b.get(f"/sandboxes/{sandbox.id}/metrics")).json()
        many = await e2b.get(f"/sandboxes/metrics?sandbox_ids={sandbox.id},sb-nobody")
        later = await sandbox.metrics(start=got[-1].at + 1)
        vm.agent.files["/proc/meminfo"] = LIES
        await metrics.sample_all()
        lied = (await sandbox.metrics())[-1]
    assert len(got) == 3  # metrics_keep: the oldest went
    sample = got[-1]
    assert sample.cpu_count == 1 and 0 <= sample.cpu_used_pct <= 100
    assert sample.mem_used == (500000 - 300000) << 10 and sample.mem_cache == 1024 << 10
    assert sample.mem_total == 512 << 20  # what the sandbox was given
    assert sample.disk_total > 0 and 0 <= sample.disk_used <= sample.disk_total
    assert later == []
    assert len(one) == 3 and set(one[0]) == {
        "timestamp", "timestampUnix", "cpuCount", "cpuUsedPct", "memUsed", "memTotal",
        "memCache", "diskUsed", "diskTotal",
    }  # fmt: skip
    assert one[-1]["memUsed"] == sample.mem_used and one[-1]["timestampUnix"] == int(sample.at)
    assert list(many.json()["sandboxes"]) == [sandbox.id]
    assert lied.mem_used <= lied.mem_total and lied.mem_cache <= lied.mem_total


async def test_logs_filter_and_page(tmp_path: Path) -> None:
    async with serving(tmp_path) as app, app.client() as client, e2b_client(app) as e2b:
        sandbox = await client.create()
        await sandbox.exec("echo one")
        await sandbox.files.write("/tmp/a.txt", b"x")
        path = f"/v2/sandboxes/{sandbox.id}/logs"
        everything = (await e2b.get(path)).json()["logs"]
        newest = (await e2b.get(path, params={"direction": "backward", "limit": 1})).json()
        found = (await e2b.get(path, params={"search": "a.txt"})).json()["logs"]
        errors_only = (await e2b.get(path, params={"level": "error"})).json()["logs"]
        first = everything[0]["timestamp"]
        old = (await e2b.get(f"/sandboxes/{sandbox.id}/logs", params={"limit": 2})).json()
        bad = await e2b.get(path, params={"limit": 5000})
    types = [e["fields"]["type"] for e in everything]
    assert types[0] == "created" and "exec" in types
    assert set(everything[0]) == {"timestamp", "level", "message", "fields"}
    assert newest["logs"] == [everything[-1]]
    assert found and all("a.txt" in e["message"] for e in found)
    assert errors_only == []
    assert old["logEntries"][0]["timestamp"] == first
    assert len(old["logs"]) == 2 and old["logs"][0]["line"] == everything[0]["message"]
    assert bad.status_code == 400 and bad.json()["code"] == 400
