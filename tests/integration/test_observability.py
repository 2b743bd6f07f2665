"""Watching sandboxes from outside, on real microVMs and a real daemon: metrics over time
that move when a guest burns CPU (an idle sandbox beside it the control), E2B's pinned SDK
(sync and async) reading metrics and logs, and lifecycle webhooks delivered from the daemon
to a receiver on loopback (reached through the operator's host table), signed, in order,
retried after a 500, in cella's and E2B's forms."""

from __future__ import annotations

import http.server
import json
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2
import pytest

from cella import Client, errors
from cella.policy import webhooks
from tests.daemon import Daemon
from tests.netservers import free_loopback_block
from tests.sdk_env import run_script, sdk_python

pytestmark = pytest.mark.vm
E2B = ["e2b==2.63.0"]
HOOKS = "hooks.test"  # the receiver's name in the operator's egress_hosts


@dataclass
class Received:
    requests: list[dict[str, Any]] = field(default_factory=list)
    failed: set[str] = field(default_factory=set)  # paths that answered 500 once already
    lock: threading.Lock = field(default_factory=threading.Lock)

    def until_killed(self, path: str, sandbox_id: str) -> list[dict[str, Any]]:
        """What came to `path` about the sandbox, once its kill has come (else [])."""
        with self.lock:
            seen = [
                r for r in self.requests if r["path"] == path and sandbox_id.encode() in r["body"]
            ]
        return seen if seen and b"killed" in seen[-1]["body"] else []


class Receiver(http.server.BaseHTTPRequestHandler):
    """Records each delivery; the first to a path ending in `/flaky` answers 500."""

    protocol_version = "HTTP/1.1"
    got: Received

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        with self.got.lock:
            self.got.requests.append(
                {
                    "path": self.path,
                    "headers": {k.lower(): v for k, v in self.headers.items()},
                    "body": body,
                }
            )
            fail = self.path.endswith("/flaky") and self.path not in self.got.failed
            self.got.failed.add(self.path)
        self.send_response(500 if fail else 204)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def receiver() -> Iterator[tuple[str, Received]]:
    addr = f"{free_loopback_block()}.1"
    got = Received()
    server = http.server.ThreadingHTTPServer((addr, 80), type("R", (Receiver,), {"got": got}))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield addr, got
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def daemon_settings(receiver: tuple[str, Received]) -> dict[str, str]:
    return {
        "pool_size": "0",
        "metrics_interval": "1",
        "webhook_backoff": "0.5",
        "egress_hosts": json.dumps({HOOKS: receiver[0]}),
    }


@pytest.fixture(scope="module")
def python() -> Path:
    return sdk_python("e2b-2.63.0", E2B)


def e2b(python: Path, daemon: Daemon, script: str) -> Any:
    env = {
        "E2B_API_URL": daemon.url,
        "E2B_SANDBOX_URL": daemon.url,
        "E2B_API_KEY": daemon.admin_key,
    }
    return run_script(python, "import json\n" + textwrap.dedent(script), env)


def wait_for(what: Callable[[], Any], timeout: float = 120) -> Any:
    """`what()` once it is truthy (polled), else the test fails saying so."""
    deadline = time.monotonic() + timeout
    while not (got := what()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.2)
    return got


def test_metrics_move_when_a_guest_burns_cpu(admin: Client) -> None:
    busy, idle = admin.create(), admin.create()
    try:
        start = time.time()
        busy.exec("sh -c 'timeout 30 sh -c \"while :; do :; done\" >/dev/null 2>&1 &'")
        # samples taken while it burns, of both sandboxes over the same window
        wait_for(lambda: len(busy.metrics(start=start + 2)) >= 4)
        end = busy.metrics(start=start + 2)[3].at
        burning = busy.metrics(start=start + 2, end=end)
        resting = idle.metrics(start=start + 2, end=end)
        assert len(resting) >= 2
    finally:
        busy.delete()
        idle.delete()
    hot = sum(m.cpu_used_pct for m in burning) / len(burning)
    cold = sum(m.cpu_used_pct for m in resting) / len(resting)
    assert hot > 25 and hot > 3 * cold, (burning, resting)
    for m in burning + resting:  # the guest's memory and disk, within what it was given
        assert m.cpu_count == 1 and m.mem_total == 512 << 20
        assert 0 < m.mem_used <= m.mem_total and 0 <= m.mem_cache <= m.mem_total
        assert 0 < m.disk_used <= m.disk_total


def test_e2b_sdk_reads_metrics_and_logs(python: Path, daemon: Daemon) -> None:
    got = e2b(
        python,
        daemon,
        """
        import asyncio, time
        from e2b import AsyncSandbox, Sandbox
        from e2b.api.client_sync import get_api_client
        from e2b.api.client.api.sandboxes import (
            get_sandboxes_metrics, get_v_2_sandboxes_sandbox_id_logs)
        from e2b.api.client.models import LogsDirection
        from e2b.connection_config import ConnectionConfig

        sb = Sandbox.create()
        sb.commands.run("echo observed-line")
        deadline = time.monotonic() + 120
        while not (metrics := sb.get_metrics()) and time.monotonic() < deadline:
            time.sleep(0.5)
        from_class = Sandbox.get_metrics(sb.sandbox_id)

        async def read() -> int:
            return len(await AsyncSandbox.get_metrics(sb.sandbox_id))

        async_count = asyncio.run(read())
        client = get_api_client(ConnectionConfig())
        many = get_sandboxes_metrics.sync_detailed(
            client=client, sandbox_ids=[sb.sandbox_id, "sb-nobody"]).parsed
        logs = get_v_2_sandboxes_sandbox_id_logs.sync_detailed(
            sb.sandbox_id, client=client, search="observed-line").parsed
        newest = get_v_2_sandboxes_sandbox_id_logs.sync_detailed(
            sb.sandbox_id, client=client, limit=1,
            direction=LogsDirection.BACKWARD).parsed
        first = get_v_2_sandboxes_sandbox_id_logs.sync_detailed(
            sb.sandbox_id, client=client, limit=1).parsed
        sb.kill()
        m = metrics[-1]
        print(json.dumps({
            "id": sb.sandbox_id,
            "metric": {"cpu": m.cpu_count, "pct": m.cpu_used_pct, "mem": m.mem_used,
                       "mem_total": m.mem_total, "disk": m.disk_used,
                       "disk_total": m.disk_total, "at": m.timestamp.isoformat()},
            "from_class": len(from_class), "async": async_count,
            "many": sorted(many.sandboxes),
            "found": [e.message for e in logs.logs],
            "levels": [str(e.level.value) for e in logs.logs],
            "newest": [e.fields.additional_properties["type"] for e in newest.logs],
            "first": [e.fields.additional_properties["type"] for e in first.logs],
        }))
        """,
    )
    m = got["metric"]
    assert m["cpu"] == 1 and 0 <= m["pct"] <= 100
    assert 0 < m["mem"] <= m["mem_total"] == 512 << 20 and 0 < m["disk"] <= m["disk_total"]
    assert got["from_class"] >= 1 and got["async"] >= 1
    assert got["many"] == [got["id"]]  # a sandbox nobody has is left out, not an error
    assert got["found"] and all("observed-line" in line for line in got["found"])
    assert set(got["levels"]) <= {"debug", "info", "warn", "error"}
    assert got["first"] == ["created"] and got["newest"] != ["created"]


def test_webhooks_signed_in_order_and_retried(
    admin: Client, daemon: Daemon, python: Path, receiver: tuple[str, Received]
) -> None:
    _, got = receiver
    with pytest.raises(errors.InvalidArgument):  # loopback by number: outside the boundary
        admin.create_webhook(f"http://{receiver[0]}/cella")
    mine = admin.create_webhook(f"http://{HOOKS}/cella/flaky")  # the control: by its name
    e2b_secret = "e2b-signing-secret-for-this-test"
    with httpx2.Client(base_url=daemon.url, headers={"X-API-KEY": daemon.admin_key}) as api:
        outside = api.post("/events/webhooks", json={"url": "http://127.0.0.1/x"})
        theirs = api.post(
            "/events/webhooks",
            json={
                "name": "e2b form",
                "url": f"http://{HOOKS}/e2b",
                "enabled": True,
                "events": ["sandbox.lifecycle.created", "sandbox.lifecycle.killed"],
                "signatureSecret": e2b_secret,
            },
        )
        listed = api.get("/events/webhooks").json()
    assert outside.status_code == 400 and outside.json()["code"] == 400
    assert theirs.status_code == 201, theirs.text
    hook = theirs.json()
    assert hook["events"] == ["sandbox.lifecycle.created", "sandbox.lifecycle.killed"]
    assert {h["id"] for h in listed} == {mine.id, hook["id"]}
    try:
        sandbox_id = e2b(
            python,
            daemon,
            """
            from e2b import Sandbox
            sb = Sandbox.create(metadata={"who": "webhooks"})
            sb.set_timeout(600)
            sb.kill()
            print(json.dumps(sb.sandbox_id))
            """,
        )
        ours = wait_for(lambda: got.until_killed("/cella/flaky", sandbox_id))
        e2bs = wait_for(lambda: got.until_killed("/e2b", sandbox_id))
        log = admin.webhook_deliveries(mine.id)
    finally:
        admin.delete_webhook(mine.id)
        with httpx2.Client(base_url=daemon.url, headers={"X-API-KEY": daemon.admin_key}) as api:
            api.delete(f"/events/webhooks/{hook['id']}")
    for request in ours:
        h = request["headers"]
        assert webhooks.verify(mine.secret, request["body"], h["cella-timestamp"],
                               h["cella-signature"])  # fmt: skip
    kinds = [json.loads(r["body"])["type"] for r in ours]
    # the first answered 500 and came again; the ones after it waited their turn
    assert kinds[:2] == ["sandbox.created", "sandbox.created"]
    assert "sandbox.updated" in kinds and kinds[-1] == "sandbox.killed"  # set_timeout; kill
    mine_log = [d for d in log if d.sandbox_id == sandbox_id]
    assert [d.event for d in mine_log] == kinds[1:]
    assert [a.status for a in mine_log[0].attempts] == [500, 204]
    assert all(d.state == "delivered" for d in mine_log)
    for request in e2bs:
        h = request["headers"]
        assert h["e2b-signature"] == webhooks.e2b_signature(e2b_secret, request["body"])
        assert h["e2b-signature"] != webhooks.e2b_signature("another", request["body"])
        assert h["e2b-webhook-id"] == hook["id"] and h["e2b-signature-version"] == "v1"
    bodies = [json.loads(r["body"]) for r in e2bs]
    assert [b["type"] for b in bodies] == ["sandbox.lifecycle.created", "sandbox.lifecycle.killed"]
    assert bodies[0]["sandboxId"] == sandbox_id and bodies[0]["version"] == "v2"
    assert bodies[0]["eventData"]["sandbox_metadata"] == {"who": "webhooks"}
