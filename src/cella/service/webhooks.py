"""Lifecycle webhooks: a tenant's URLs (kept with a sealed signing secret), told of its
sandboxes' lifecycle events (`cella.policy.webhooks` says which, in what body and how
signed). Each event is written as a pending delivery when it happens (so a restarted daemon
still sends it) and handed to `Deliveries`, which sends them in order per webhook and
sandbox from the daemon itself, to destinations inside the operator's boundary only.

A webhook sees every sandbox of its tenant, so only a key that sees them all (the `owner`
role) manages webhooks."""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Callable
from typing import Any

from cella import errors
from cella.models import WebhookCreate, WebhookUpdate
from cella.policy import webhooks as policy
from cella.policy.access import Principal
from cella.service.registry import Registry
from cella.service.webhook_delivery import Deliveries
from cella.store import DeliveryRecord, WebhookRecord

MAX_WEBHOOKS = 32  # per tenant
FLAVORS = ("cella", "e2b")


class Webhooks:
    def __init__(self, registry: Registry, deliveries: Deliveries) -> None:
        self.registry = registry
        self.store = registry.store
        self.deliveries = deliveries
        self._hooks: dict[str, list[WebhookRecord]] = {}  # tenant -> its webhooks, cached

    def _may(self, who: Principal) -> None:
        if not who.wide:
            raise errors.PermissionDenied(
                "webhooks are told of every sandbox of the tenant: only an owner key manages them"
            )

    def _changed(self, tenant: str) -> None:
        self._hooks.pop(tenant, None)

    async def create(
        self, who: Principal, spec: WebhookCreate, flavor: str = "cella"
    ) -> WebhookRecord:
        self._may(who)
        if flavor not in FLAVORS:
            raise errors.InvalidArgument(f"unknown webhook form {flavor!r}")
        if len(self.store.list_webhooks(who.tenant)) >= MAX_WEBHOOKS:
            raise errors.InvalidArgument(f"a tenant has at most {MAX_WEBHOOKS} webhooks")
        url = await self.deliveries.check(spec.url)
        hook = WebhookRecord(
            id="wh-" + secrets.token_hex(8),
            tenant=who.tenant,
            name=spec.name,
            url=url,
            events=list(dict.fromkeys(spec.events)),
            secret=spec.secret or "whsec_" + secrets.token_urlsafe(32),
            enabled=spec.enabled,
            flavor=flavor,
        )
        self.store.put_webhook(hook)
        self._changed(who.tenant)
        return hook

    async def put_shared(self, hook: WebhookRecord) -> WebhookRecord:
        """A fleet gateway's webhook as the gateway keeps it (same id and secret on every
        node, so a receiver verifies every node's deliveries alike); its URL is held to
        this node's boundary."""
        if hook.flavor not in FLAVORS:
            raise errors.InvalidArgument(f"unknown webhook form {hook.flavor!r}")
        have = self.store.get_webhook(hook.tenant, hook.id)
        if have is None and len(self.store.list_webhooks(hook.tenant)) >= MAX_WEBHOOKS:
            raise errors.InvalidArgument(f"a tenant has at most {MAX_WEBHOOKS} webhooks")
        hook.url = await self.deliveries.check(hook.url)
        self.store.put_webhook(hook)
        self._changed(hook.tenant)
        return hook

    def all(self, who: Principal) -> list[WebhookRecord]:
        self._may(who)
        return self.store.list_webhooks(who.tenant)

    def get(self, who: Principal, webhook_id: str) -> WebhookRecord:
        self._may(who)
        hook = self.store.get_webhook(who.tenant, webhook_id)
        if hook is None:
            raise errors.NotFound(f"webhook {webhook_id} not found")
        return hook

    async def update(self, who: Principal, webhook_id: str, spec: WebhookUpdate) -> WebhookRecord:
        hook = self.get(who, webhook_id)
        if spec.url is not None:
            hook.url = await self.deliveries.check(spec.url)
        if spec.name is not None:
            hook.name = spec.name
        if spec.events is not None:
            hook.events = list(dict.fromkeys(spec.events))
        if spec.enabled is not None:
            hook.enabled = spec.enabled
        if spec.secret is not None:
            hook.secret = spec.secret
        self.store.put_webhook(hook)
        self._changed(who.tenant)
        return hook

    def delete(self, who: Principal, webhook_id: str) -> None:
        self._may(who)
        if not self.store.delete_webhook(who.tenant, webhook_id):
            raise errors.NotFound(f"webhook {webhook_id} not found")
        self._changed(who.tenant)

    def delivery_log(
        self, who: Principal, webhook_id: str, after: int = 0, limit: int = 100
    ) -> list[DeliveryRecord]:
        """The webhook's deliveries (pending, delivered, failed) with each attempt."""
        self.get(who, webhook_id)
        return self.store.deliveries(who.tenant, webhook_id, after, limit)

    # -- events -----------------------------------------------------------------------------

    def sink(self) -> Callable[[dict[str, Any]], None]:
        """The event log's sink that turns lifecycle events into deliveries."""
        return self._on_event

    def _on_event(self, event: dict[str, Any]) -> None:
        name = policy.FROM_TRACE.get(event["type"])
        if name is None:
            return
        row = self.store.get_sandbox(event["sandbox_id"])
        if row is None:
            return
        hooks = self._hooks.get(row.tenant)
        if hooks is None:
            hooks = self._hooks[row.tenant] = self.store.list_webhooks(row.tenant)
        sandbox = {
            "id": row.id,
            "tenant": row.tenant,
            "template": row.template,
            "state": str(row.state),
            "labels": row.labels,
        }
        data = {k: v for k, v in (event.get("data") or {}).items() if k != "error"}
        queued = False
        for hook in hooks:
            if not hook.enabled or name not in hook.events:
                continue
            key = f"{hook.id}-{event['id']}"
            body = policy.body(hook.flavor, name, key, sandbox, data, _epoch(event["at"]))
            self.store.add_delivery(hook, row.id, name, body)
            queued = True
        if queued:
            self.deliveries.wake()


def _epoch(at: str) -> float:
    from datetime import datetime

    with contextlib.suppress(ValueError):
        return datetime.fromisoformat(at).timestamp()
    return 0.0
