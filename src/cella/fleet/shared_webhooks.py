"""Lifecycle webhooks on a fleet: kept by the gateway (their secrets sealed under its key) and
put on every node with the same id and secret (`PUT /v1/webhooks/{id}`, the gateway's admin
key), since a sandbox may be placed on any and its node sends its events; a node that joins
gets them all first. Each node holds a URL to its own boundary: the first node to refuse one
refuses the registration, and nothing of it is left anywhere. Deliveries are each node's,
listed together."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import secrets
from typing import Any

from cella import errors
from cella.fleet.membership import Membership
from cella.fleet.node_client import Node, raise_for
from cella.models import WebhookCreate, WebhookUpdate
from cella.models.observe import SharedWebhook
from cella.policy.access import Principal
from cella.service.webhooks import FLAVORS, MAX_WEBHOOKS
from cella.store import Store, WebhookRecord

log = logging.getLogger("cella.fleet.webhooks")


class SharedWebhooks:
    def __init__(self, store: Store, membership: Membership) -> None:
        self.store = store
        self.membership = membership

    def _may(self, who: Principal) -> None:
        if not who.wide:
            raise errors.PermissionDenied(
                "webhooks are told of every sandbox of the tenant: only an owner key manages them"
            )

    async def create(
        self, who: Principal, spec: WebhookCreate, flavor: str = "cella"
    ) -> WebhookRecord:
        self._may(who)
        if flavor not in FLAVORS:
            raise errors.InvalidArgument(f"unknown webhook form {flavor!r}")
        if len(self.store.list_webhooks(who.tenant)) >= MAX_WEBHOOKS:
            raise errors.InvalidArgument(f"a tenant has at most {MAX_WEBHOOKS} webhooks")
        hook = WebhookRecord(
            id="wh-" + secrets.token_hex(8),
            tenant=who.tenant,
            name=spec.name,
            url=spec.url,
            events=list(dict.fromkeys(spec.events)),
            secret=spec.secret or "whsec_" + secrets.token_urlsafe(32),
            enabled=spec.enabled,
            flavor=flavor,
        )
        self.store.put_webhook(hook)  # written first: a gateway that dies here still knows it
        try:
            await self._everywhere(hook)
        except BaseException:
            with contextlib.suppress(errors.CellaError):
                await self._remove(who, hook.id)
            self.store.delete_webhook(who.tenant, hook.id)
            raise
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
        """Fields given replace the webhook's, here and on every node (a URL a node refuses
        changes nothing)."""
        hook = self.get(who, webhook_id)
        before = dataclasses.replace(hook, events=list(hook.events))
        for field in ("url", "name", "events", "enabled", "secret"):
            value = getattr(spec, field)
            if value is not None:
                setattr(hook, field, list(dict.fromkeys(value)) if field == "events" else value)
        try:
            await self._everywhere(hook)
        except BaseException:
            with contextlib.suppress(errors.CellaError):
                await self._everywhere(before)
            raise
        self.store.put_webhook(hook)
        return hook

    async def delete(self, who: Principal, webhook_id: str) -> None:
        self._may(who)
        if not self.store.delete_webhook(who.tenant, webhook_id):
            raise errors.NotFound(f"webhook {webhook_id} not found")
        await self._remove(who, webhook_id)

    async def deliveries(
        self, who: Principal, webhook_id: str, after: int = 0, limit: int = 100
    ) -> list[dict[str, Any]]:
        """Every node's deliveries of the webhook (`after`: a delivery id of each node's),
        oldest first, each with the node that sent it."""
        self.get(who, webhook_id)
        params = {"after": after, "limit": limit}
        found = []
        path = f"/v1/webhooks/{webhook_id}/deliveries"
        for node, answer in await self.membership.each("GET", path, who, params=params):
            found += [{**d, "node": node.name} for d in answer["deliveries"]]
        found.sort(key=lambda d: (str(d["created_at"]), d["node"], d["id"]))
        return found[:limit]

    async def push_to(self, node: Node) -> None:
        """A joining node gets every tenant's webhooks as they are kept here (one whose URL
        this node holds outside its boundary is left out, said in the log: the node still
        joins)."""
        for hook in self.store.list_webhooks(None):
            try:
                await self._put(node, hook)
            except errors.InvalidArgument as exc:
                log.warning("webhook %s not put on node %s: %s", hook.id, node.name, exc)

    async def _everywhere(self, hook: WebhookRecord) -> None:
        """The webhook on every healthy node, one after another: the first refusal stops
        it (a URL outside the boundary is refused alike by every node)."""
        for node in self.membership.healthy():
            await self._put(node, hook)

    async def _put(self, node: Node, hook: WebhookRecord) -> None:
        body = SharedWebhook(
            tenant=hook.tenant,
            name=hook.name,
            url=hook.url,
            events=hook.events,  # type: ignore[arg-type]
            secret=hook.secret,
            enabled=hook.enabled,
            flavor=hook.flavor,  # type: ignore[arg-type]
        )
        await node.json("PUT", f"/v1/webhooks/{hook.id}", json=body.model_dump())

    async def _remove(self, who: Principal, webhook_id: str) -> None:
        for node in self.membership.healthy():
            answer = await node.call("DELETE", f"/v1/webhooks/{webhook_id}", who)
            if answer.status_code != 404:  # one that joined after a failed push lacks it
                raise_for(answer, node.name)
