"""Lifecycle webhooks through the real app (fake runtime) to a real receiver on loopback:
the operator's boundary at registration, signed deliveries in order, a retry after a 500,
the delivery log; and the signature's own rules."""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cella import errors
from cella.policy import webhooks
from cella.store.sealing import seal_store
from tests.unit.in_process import InProcess, serving


class Receiver(http.server.BaseHTTPRequestHandler):
    """Records every POST; answers 500 to the first `fail_first` of them."""

    protocol_version = "HTTP/1.1"
    seen: list[dict[str, Any]]
    fail_first: int

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        headers = {k.lower(): v for k, v in self.headers.items()}
        self.seen.append({"path": self.path, "headers": headers, "body": body})
        status = 500 if len(self.seen) <= self.fail_first else 200
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def receiver() -> Iterator[tuple[int, list[dict[str, Any]]]]:
    seen: list[dict[str, Any]] = []
    handler = type("R", (Receiver,), {"seen": seen, "fail_first": 1})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1], seen
    server.shutdown()
    server.server_close()


def sealed(app: InProcess, root: Path) -> None:
    seal_store(app.daemon.store, root / "secrets.key", None)


async def test_the_boundary_holds_webhook_urls(tmp_path: Path) -> None:
    """Loopback, private and metadata addresses (by number or by a name resolving there)
    are refused; the control, a name the operator's egress_hosts maps to loopback, is not."""
    async with serving(tmp_path, egress_hosts={"hooks.test": "127.0.0.1"}) as app:
        sealed(app, tmp_path)
        async with app.client() as client:
            for url in (
                "http://127.0.0.1:8080/hook",
                "http://localhost/hook",
                "http://10.1.2.3/hook",
                "http://169.254.169.254/latest",
                "http://[::1]/hook",
                "ftp://hooks.test/hook",
            ):
                with pytest.raises(errors.InvalidArgument) as refused:
                    await client.create_webhook(url)
                assert "webhook URL" in str(refused.value)
            made = await client.create_webhook("http://hooks.test:8080/hook")
            assert made.url == "http://hooks.test:8080/hook" and made.secret.startswith("whsec_")
            with pytest.raises(errors.InvalidArgument):
                await client.update_webhook(made.id, url="http://127.0.0.1/hook")
            assert [w.id for w in await client.webhooks()] == [made.id]


async def test_deliveries_are_signed_in_order_and_retried(
    tmp_path: Path, receiver: tuple[int, list[dict[str, Any]]]
) -> None:
    port, seen = receiver
    async with serving(
        tmp_path, egress_hosts={"hooks.test": "127.0.0.1"}, webhook_backoff=0.2
    ) as app:
        sealed(app, tmp_path)
        app.daemon.webhooks.deliveries.start()
        try:
            async with app.client() as client:
                hook = await client.create_webhook(
                    f"http://hooks.test:{port}/in", events=["sandbox.created", "sandbox.killed"]
                )
                sandbox = await client.create()
                await sandbox.delete()
                deadline = time.monotonic() + 30
                while len(seen) < 3 and time.monotonic() < deadline:
                    await _sleep()
                log = await client.webhook_deliveries(hook.id)
        finally:
            await app.daemon.webhooks.deliveries.close()
    assert len(seen) == 3, seen  # the first answered 500 and was sent again
    for request in seen:
        h = request["headers"]
        assert h["host"] == f"hooks.test:{port}" and h["cella-webhook-id"] == hook.id
        assert webhooks.verify(
            hook.secret, request["body"], h["cella-timestamp"], h["cella-signature"]
        )
        assert not webhooks.verify(  # control: another secret does not verify it
            "another-secret-entirely", request["body"], h["cella-timestamp"], h["cella-signature"]
        )
    bodies = [json.loads(r["body"]) for r in seen]
    assert [b["type"] for b in bodies] == ["sandbox.created", "sandbox.created", "sandbox.killed"]
    assert {b["sandbox"]["id"] for b in bodies} == {sandbox.id}
    assert [d.event for d in log] == ["sandbox.created", "sandbox.killed"]
    assert [d.state for d in log] == ["delivered", "delivered"]
    assert [a.status for a in log[0].attempts] == [500, 200]
    assert log[0].attempts[0].error == "answered 500"
    assert [a.status for a in log[1].attempts] == [200]
    assert log[0].body.encode() == seen[1]["body"]


async def test_every_lifecycle_event_and_a_disabled_webhook(
    tmp_path: Path, receiver: tuple[int, list[dict[str, Any]]]
) -> None:
    """All five events, in the order they happened (the receiver's first answer is a 500:
    that delivery comes again, before the rest); a disabled webhook is sent none."""
    port, seen = receiver
    async with serving(
        tmp_path, egress_hosts={"hooks.test": "127.0.0.1"}, webhook_backoff=0.2
    ) as app:
        sealed(app, tmp_path)
        app.daemon.webhooks.deliveries.start()
        try:
            async with app.client() as client:
                off = await client.create_webhook(f"http://hooks.test:{port}/off", enabled=False)
                hook = await client.create_webhook(f"http://hooks.test:{port}/all")
                sandbox = await client.create()
                await sandbox.share(visibility="private")
                await sandbox.pause()
                await sandbox.resume()
                await sandbox.delete()
                deadline = time.monotonic() + 30
                while len(seen) < 6 and time.monotonic() < deadline:
                    await _sleep()
                assert await client.webhook_deliveries(off.id) == []
        finally:
            await app.daemon.webhooks.deliveries.close()
    assert {r["path"] for r in seen} == {"/all"}
    kinds = [json.loads(r["body"])["type"] for r in seen[1:]]
    assert kinds == [
        "sandbox.created", "sandbox.updated", "sandbox.paused", "sandbox.resumed",
        "sandbox.killed",
    ]  # fmt: skip
    assert all(r["headers"]["cella-webhook-id"] == hook.id for r in seen)


async def test_only_owners_manage_webhooks(tmp_path: Path) -> None:
    """A member's key sees only its own sandboxes, so it may not be told of all of them."""
    async with serving(tmp_path, egress_hosts={"hooks.test": "127.0.0.1"}) as app:
        sealed(app, tmp_path)
        async with app.client() as admin:
            member = await admin.create_key("t1", roles=["member"])
            owner = await admin.create_key("t1")
        async with app.client(member["key"]) as client:
            with pytest.raises(errors.PermissionDenied):
                await client.create_webhook("http://hooks.test/hook")
        async with app.client(owner["key"]) as client:  # the control
            made = await client.create_webhook("http://hooks.test/hook")
            assert (await client.get_webhook(made.id)).id == made.id
            await client.delete_webhook(made.id)
            assert await client.webhooks() == []


def test_signature_rules() -> None:
    body, secret = b'{"type":"sandbox.created"}', "whsec_0123456789abcdef"
    stamp = int(time.time())
    signed = webhooks.signature(secret, stamp, body)
    assert webhooks.verify(secret, body, str(stamp), signed)
    assert not webhooks.verify(secret, body + b" ", str(stamp), signed)  # altered body
    assert not webhooks.verify(secret, body, str(stamp - 1), signed)  # another timestamp
    old = stamp - webhooks.MAX_AGE - 10
    assert not webhooks.verify(secret, body, str(old), webhooks.signature(secret, old, body))
    # E2B's: unpadded base64 of SHA-256(secret + body)
    assert webhooks.e2b_signature("s", b"x") == "l0DJ3NtEh9jNY9KlRNjmVz8IIIHEmu8Ix4U6sPmeAZo"
    assert webhooks.e2b_event("sandbox.killed") == "sandbox.lifecycle.killed"
    assert webhooks.from_e2b_event("sandbox.lifecycle.paused") == "sandbox.paused"
    with pytest.raises(ValueError):
        webhooks.from_e2b_event("sandbox.lifecycle.checkpointed")
    assert [webhooks.backoff(n, 2.0) for n in (1, 2, 3)] == [2.0, 4.0, 8.0]


async def _sleep() -> None:
    import asyncio

    await asyncio.sleep(0.05)
