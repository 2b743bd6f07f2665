"""Webhook deliveries leave from the daemon: each pending delivery is POSTed, signed, to its
webhook's URL, in order per webhook and sandbox (the next waits until the one before it is
delivered or given up), retried with backoff after a connect error, a timeout, a 408, a 429
or a 5xx, up to `webhook_attempts` tries; any other answer of 300 or more fails it at once.

A URL is held to the operator's boundary as a sandbox's destinations are (checked when it is
registered and again at every attempt): a name in the operator's `egress_hosts` goes where
the table says; any other name must resolve to a public address, or one inside
`egress_tenant_networks`; the host's own addresses, loopback, private, link-local and
metadata addresses are refused. The request goes to the address checked (no second lookup)
and follows no redirect."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import httpx2

from cella import errors
from cella.config import DaemonSettings
from cella.policy import webhooks as policy
from cella.policy.egress import Boundary, IPAddress
from cella.store import DeliveryRecord, Store, WebhookRecord
from cella.store.db import now

log = logging.getLogger("cella.webhooks")
TIMEOUT = 10.0
AT_ONCE = 8  # deliveries in flight together (each to a different webhook and sandbox)
KEEP = 1000  # finished deliveries kept per webhook
RETRIED = frozenset({408, 429})
MAX_ERROR = 300


class Deliveries:
    def __init__(
        self, settings: DaemonSettings, store: Store, boundary: Callable[[], Boundary]
    ) -> None:
        self.store = store
        self.hosts = settings.egress_host_table()
        self.boundary = boundary
        self.attempts = settings.webhook_attempts
        self.backoff = settings.webhook_backoff
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._trimmed = 0.0

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def wake(self) -> None:
        self._wake.set()

    # -- the boundary -----------------------------------------------------------------------

    async def check(self, url: str) -> str:
        """The URL, if the daemon may deliver to it; else InvalidArgument saying why."""
        await self._destination(url)
        return url

    async def _destination(self, url: str) -> tuple[str, IPAddress]:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise errors.InvalidArgument(f"webhook URL {url!r}: not an http(s) URL")
        if parts.username or parts.password:
            raise errors.InvalidArgument("webhook URL: credentials in the URL are not allowed")
        try:
            port = parts.port
        except ValueError:
            port = 0
        if port == 0:
            raise errors.InvalidArgument(f"webhook URL {url!r}: bad port")
        name = parts.hostname.lower().rstrip(".")
        if name in self.hosts:  # the operator's table: its addresses are the operator's call
            return name, ipaddress.ip_address(self.hosts[name][0])
        try:
            found = [ipaddress.ip_address(name)]
        except ValueError:
            found = await _resolve(name)
        if not found:
            raise errors.InvalidArgument(f"webhook URL {url!r}: {name} does not resolve")
        boundary, why = self.boundary(), ""
        for address in found:
            closed = boundary.closed(address)
            if closed is None or boundary.opened(address):
                return name, address
            why = closed
        raise errors.InvalidArgument(
            f"webhook URL {url!r}: {why}, outside the operator's boundary (only a name in "
            "the operator's egress_hosts, or an address in egress_tenant_networks, reaches "
            "addresses that are not public)"
        )

    # -- sending ----------------------------------------------------------------------------

    async def _loop(self) -> None:
        async with httpx2.AsyncClient(timeout=TIMEOUT, follow_redirects=False) as client:
            while True:
                self._wake.clear()
                try:
                    soonest = await self._pass(client)
                except Exception:
                    log.exception("a webhook delivery pass failed")
                    soonest = time.time() + 5
                wait = None if soonest is None else max(0.0, soonest - time.time())
                if wait == 0.0:
                    continue
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), wait)

    async def _pass(self, client: httpx2.AsyncClient) -> float | None:
        """Tries the first pending delivery of each webhook and sandbox that is due; returns
        when the next one is due (None: nothing is pending)."""
        moment, soonest = time.time(), None
        due = []
        for delivery in self.store.pending_heads():
            if delivery.next_at > moment:
                soonest = min(soonest or delivery.next_at, delivery.next_at)
            else:
                due.append(delivery)
        gate = asyncio.Semaphore(AT_ONCE)

        async def one(delivery: DeliveryRecord) -> None:
            async with gate:
                await self._attempt(client, delivery)

        await asyncio.gather(*(one(d) for d in due))
        if due:
            soonest = moment  # the ones behind them may be due now
        if moment - self._trimmed > 60:
            self._trimmed = moment
            self.store.trim_deliveries(KEEP)
        return soonest

    async def _attempt(self, client: httpx2.AsyncClient, delivery: DeliveryRecord) -> None:
        hook = self.store.get_webhook(delivery.tenant, delivery.webhook_id)
        started = time.monotonic()
        attempt: dict[str, object] = {"at": now(), "status": None, "error": None}
        retry = False
        if hook is None or not hook.enabled:
            attempt["error"] = "the webhook is disabled"
        else:
            try:
                status = await self._post(client, hook, delivery)
                attempt["status"] = status
                retry = status >= 500 or status in RETRIED
                if status >= 300:
                    attempt["error"] = f"answered {status}"
            except errors.CellaError as exc:
                attempt["error"], retry = str(exc)[:MAX_ERROR], True
            except (httpx2.HTTPError, OSError) as exc:
                attempt["error"] = f"{type(exc).__name__}: {exc}"[:MAX_ERROR]
                retry = True
        attempt["duration_ms"] = round((time.monotonic() - started) * 1000, 1)
        delivery.attempts.append(attempt)
        if attempt["error"] is None:
            delivery.state, delivery.delivered_at = "delivered", now()
        elif retry and len(delivery.attempts) < self.attempts:
            delivery.next_at = time.time() + policy.backoff(len(delivery.attempts), self.backoff)
        else:
            delivery.state = "failed"
        self.store.update_delivery(delivery)

    async def _post(
        self, client: httpx2.AsyncClient, hook: WebhookRecord, delivery: DeliveryRecord
    ) -> int:
        name, address = await self._destination(hook.url)
        parts = urlsplit(hook.url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        host = f"[{address}]" if address.version == 6 else str(address)
        target = parts.path or "/"
        if parts.query:
            target += "?" + parts.query
        payload = delivery.body.encode()
        headers = {
            "Host": parts.netloc.rpartition("@")[2],
            "Content-Type": "application/json",
            "User-Agent": "cella-webhooks",
            **policy.headers(
                hook.flavor, hook.secret, hook.id, delivery.id, delivery.event, payload
            ),
        }
        extensions = {"sni_hostname": name} if parts.scheme == "https" else {}
        answer = await client.post(
            f"{parts.scheme}://{host}:{port}{target}",
            content=payload,
            headers=headers,
            extensions=extensions,
        )
        return answer.status_code


async def _resolve(name: str) -> list[IPAddress]:
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except OSError:
        return []
    return list(dict.fromkeys(ipaddress.ip_address(i[4][0]) for i in infos))
