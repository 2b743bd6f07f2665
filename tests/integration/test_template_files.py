"""Template files (E2B's `Template.copy` uploads) on a real daemon over HTTP, through E2B's
upload-link call and the signed link it hands out: a tenant's quota refuses an upload past
it with 413 while what it holds stays present (control: an upload within it is taken), and
once a file no build names is older than the keep time it is removed and the room is
there again."""

from __future__ import annotations

import hashlib
import time
from typing import Any

import httpx2
import pytest

from tests.daemon import Daemon, DaemonFactory

pytestmark = [pytest.mark.vm, pytest.mark.timeout(600)]
KEEP_SECONDS = 12.0  # long enough for the quota's calls, short for the clean-up's wait
KiB = 1024


@pytest.fixture(scope="module")
def daemon(module_daemon_factory: DaemonFactory) -> Daemon:
    return module_daemon_factory(
        "template-files",
        pool_size="0",
        template_files_quota_mib="1",
        template_files_keep_hours=str(KEEP_SECONDS / 3600),
    )


def link(daemon: Daemon, template_id: str, data: bytes) -> dict[str, Any]:
    digest = hashlib.sha256(data).hexdigest()
    got = httpx2.get(
        f"{daemon.url}/templates/{template_id}/files/{digest}",
        headers={"X-API-KEY": daemon.admin_key},
        timeout=30,
    )
    assert got.status_code == 201, got.text
    return dict(got.json())


def upload(url: str, data: bytes) -> httpx2.Response:
    return httpx2.put(url, content=data, timeout=60)


def test_the_quota_refuses_past_it_and_the_sweep_makes_room(daemon: Daemon) -> None:
    made = httpx2.post(
        f"{daemon.url}/v3/templates",
        json={"name": "files-quota"},
        headers={"X-API-KEY": daemon.admin_key},
        timeout=30,
    )
    assert made.status_code == 202, made.text
    template_id = made.json()["templateID"]
    first, second = b"a" * (700 * KiB), b"b" * (700 * KiB)
    asked = link(daemon, template_id, first)
    assert asked["present"] is False
    assert upload(asked["url"], first).status_code == 200  # control: within the quota
    assert link(daemon, template_id, first)["present"] is True

    refused = upload(link(daemon, template_id, second)["url"], second)
    assert refused.status_code == 413, refused.text
    assert "quota of 1 MiB" in refused.json()["error"]["message"]
    assert link(daemon, template_id, second)["present"] is False  # nothing half kept
    assert link(daemon, template_id, first)["present"] is True  # nothing lost

    # no build names the first file: once older than the keep time it is removed (by the
    # daemon's sweep, or by the next upload that needs its room), and the second fits
    url = link(daemon, template_id, second)["url"]
    deadline = time.monotonic() + KEEP_SECONDS * 6
    while (done := upload(url, second)).status_code == 413 and time.monotonic() < deadline:
        time.sleep(2)
    assert done.status_code == 200, done.text
    assert link(daemon, template_id, second)["present"] is True
    first_path = hashlib.sha256(first).hexdigest()
    assert not list(daemon.data_dir.joinpath("template-files").rglob(first_path))
