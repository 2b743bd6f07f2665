"""What E2B's SDK can call and cella does not serve answers by name, in E2B's error shape
(through the real app, fake runtime); the paths cella does serve stay served."""

from __future__ import annotations

from pathlib import Path

import httpx2
import pytest

from cella.server.compat.e2b.unserved import UNSERVED
from tests.unit.in_process import serving

CALLS = [
    ("POST", "/templates", "v1 builds"),
    ("POST", "/templates/t-1/builds/b-1", "v1 builds"),
    ("PATCH", "/v2/templates/t-1", "public templates"),
    ("GET", "/templates/t-1/tags/count", "tag counts"),
    ("GET", "/default-templates", "default templates"),
]


@pytest.mark.parametrize(("method", "path", "named"), CALLS)
async def test_unserved_calls_are_named_in_e2bs_shape(
    tmp_path: Path, method: str, path: str, named: str
) -> None:
    async with serving(tmp_path) as app:
        transport = httpx2.ASGITransport(app=app.app)
        async with httpx2.AsyncClient(transport=transport, base_url="http://cella.test") as c:
            r = await c.request(method, path, headers={"X-API-KEY": app.admin_key}, json={})
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["code"] == 400  # E2B's `{code, message}`: the SDK reads both
    assert named in body["message"] and "not supported by cella" in body["message"]
    assert path in body["message"]


async def test_served_paths_are_not_shadowed(tmp_path: Path) -> None:
    """The control: a sandbox's info and a snapshot's deletion (E2B deletes snapshots as
    templates) and volumes still reach cella's routes: unknown ids are E2B's 404, not a
    refusal."""
    assert all("DELETE" not in m for p, _, m in UNSERVED if p.startswith("/templates/"))
    async with serving(tmp_path) as app:
        transport = httpx2.ASGITransport(app=app.app)
        async with httpx2.AsyncClient(transport=transport, base_url="http://cella.test") as c:
            head = {"X-API-KEY": app.admin_key}
            info = await c.get("/sandboxes/sb-0000000000000000", headers=head)
            gone = await c.delete("/templates/no-such-snapshot", headers=head)
            listed = await c.get("/snapshots", headers=head)
            volume = await c.get("/volumes/vol-0000000000000000", headers=head)
            volumes = await c.get("/volumes", headers=head)
    assert info.status_code == 404 and info.json()["code"] == 404
    assert volume.status_code == 404 and volume.json()["code"] == 404
    assert volumes.status_code == 200 and volumes.json() == []
    assert gone.status_code == 404 and gone.json()["code"] == 404
    assert listed.status_code == 200 and listed.json() == []


async def test_metrics_and_logs_are_served(tmp_path: Path) -> None:
    """`/sandboxes/metrics` is no sandbox id: it wants `sandbox_ids` (E2B's 400 without,
    an empty map for ids nobody has); a missing sandbox's metrics and logs are E2B's 404."""
    async with serving(tmp_path) as app:
        transport = httpx2.ASGITransport(app=app.app)
        async with httpx2.AsyncClient(transport=transport, base_url="http://cella.test") as c:
            head = {"X-API-KEY": app.admin_key}
            bare = await c.get("/sandboxes/metrics", headers=head)
            many = await c.get("/sandboxes/metrics?sandbox_ids=sb-1,sb-2", headers=head)
            one = await c.get("/sandboxes/sb-0000000000000000/metrics", headers=head)
            logs = await c.get("/v2/sandboxes/sb-0000000000000000/logs", headers=head)
            bad = await c.get("/v2/sandboxes/sb-1/logs?direction=sideways", headers=head)
    assert bare.status_code == 400 and "sandbox_ids" in bare.json()["message"]
    assert many.status_code == 200 and many.json() == {"sandboxes": {}}
    assert one.status_code == 404 and one.json()["code"] == 404
    assert logs.status_code == 404 and logs.json()["code"] == 404
    assert bad.status_code == 400 and "direction" in bad.json()["message"]


async def test_refreshes_extend_and_never_shorten(tmp_path: Path) -> None:
    """`POST /sandboxes/{id}/refreshes`: alive at least `duration` more seconds; a shorter
    refresh leaves the lifetime as it was (E2B's keep-alive, unlike set_timeout)."""
    async with serving(tmp_path) as app:
        transport = httpx2.ASGITransport(app=app.app)
        async with httpx2.AsyncClient(transport=transport, base_url="http://cella.test") as c:
            head = {"X-API-KEY": app.admin_key}
            made = await c.post("/sandboxes", headers=head, json={"timeout": 30})
            assert made.status_code == 201, made.text
            sid = made.json()["sandboxID"]

            def ttl() -> int | None:
                return app.daemon.registry.store.get_sandbox(sid).ttl_seconds

            before = ttl()
            assert before is not None and before < 60
            r = await c.post(f"/sandboxes/{sid}/refreshes", headers=head, json={"duration": 600})
            assert r.status_code == 204, r.text
            longer = ttl()
            assert longer is not None and longer >= 600
            r = await c.post(f"/sandboxes/{sid}/refreshes", headers=head, json={"duration": 20})
            assert r.status_code == 204 and ttl() == longer
            r = await c.post(f"/sandboxes/{sid}/refreshes", headers=head, json={"duration": 9999})
            assert r.status_code == 400 and "at most 3600" in r.json()["message"]
            r = await c.post("/sandboxes/sb-0000000000000000/refreshes", headers=head, json={})
            assert r.status_code == 404 and r.json()["code"] == 404
