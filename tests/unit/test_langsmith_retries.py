"""A LangSmith create retried (the app in process, fake runtime): without a key the name,
unique per tenant, refuses the second (409) and nothing is made twice; with an
`Idempotency-Key` both get the one sandbox."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx2

from tests.unit.in_process import serving

BOXES = "/api/v2/sandboxes/boxes"


async def test_a_retried_create_never_makes_two(tmp_path: Path) -> None:
    async with serving(tmp_path) as app:
        transport = httpx2.ASGITransport(app=app.app)
        async with httpx2.AsyncClient(transport=transport, base_url="http://cella.test") as c:
            head = {"X-Api-Key": app.admin_key}
            body = {"name": "retried"}
            plain = await asyncio.gather(*(c.post(BOXES, headers=head, json=body) for _ in "ab"))
            assert sorted(r.status_code for r in plain) == [200, 409], [r.text for r in plain]
            keyed = {**head, "Idempotency-Key": "ls-1"}
            body = {"name": "keyed"}
            both = await asyncio.gather(*(c.post(BOXES, headers=keyed, json=body) for _ in "ab"))
            assert [r.status_code for r in both] == [200, 200], [r.text for r in both]
            assert both[0].json()["id"] == both[1].json()["id"]
            rows = app.daemon.store.list_sandboxes(None, None)
            names = sorted(r.name or "" for r in rows if r.state != "error")
            assert names == ["keyed", "retried"]
