"""Lifecycle webhooks: a tenant's URLs told, signed, of its sandboxes' lifecycle events, and
the log of what was delivered (`cella.policy.webhooks` documents the signature)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Response

from cella.models import (
    Webhook,
    WebhookCreate,
    WebhookCreated,
    WebhookDelivery,
    WebhookDeliveryList,
    WebhookList,
    WebhookUpdate,
)
from cella.models.observe import SharedWebhook
from cella.server.deps import Auth, DaemonDep
from cella.service.keys import require_admin
from cella.store import WebhookRecord

router = APIRouter(prefix="/v1/webhooks", tags=["webhooks"])


@router.post("", status_code=201, response_model=WebhookCreated)
async def create_webhook(body: WebhookCreate, svc: DaemonDep, who: Auth) -> WebhookCreated:
    """Registers a URL (held to the operator's boundary); the answer carries its secret."""
    hook = await svc.webhooks.create(who, body)
    return WebhookCreated.model_validate(hook, from_attributes=True)


@router.get("", response_model=WebhookList)
async def list_webhooks(svc: DaemonDep, who: Auth) -> WebhookList:
    hooks = svc.webhooks.all(who)
    return WebhookList(webhooks=[Webhook.model_validate(h) for h in hooks])


@router.get("/{webhook_id}", response_model=Webhook)
async def get_webhook(webhook_id: str, svc: DaemonDep, who: Auth) -> Webhook:
    return Webhook.model_validate(svc.webhooks.get(who, webhook_id))


@router.patch("/{webhook_id}", response_model=Webhook)
async def update_webhook(
    webhook_id: str, body: WebhookUpdate, svc: DaemonDep, who: Auth
) -> Webhook:
    """Fields given replace the webhook's (a new secret too)."""
    return Webhook.model_validate(await svc.webhooks.update(who, webhook_id, body))


@router.put("/{webhook_id}", response_model=Webhook, include_in_schema=False)
async def put_shared(webhook_id: str, body: SharedWebhook, svc: DaemonDep, who: Auth) -> Webhook:
    """A fleet gateway's webhook, as the gateway keeps it (an admin key: the gateway's)."""
    require_admin(who, "put a fleet's webhook")
    hook = WebhookRecord(id=webhook_id, **body.model_dump())
    return Webhook.model_validate(await svc.webhooks.put_shared(hook))


@router.delete("/{webhook_id}", status_code=204)
async def delete_webhook(webhook_id: str, svc: DaemonDep, who: Auth) -> Response:
    svc.webhooks.delete(who, webhook_id)
    return Response(status_code=204)


@router.get("/{webhook_id}/deliveries", response_model=WebhookDeliveryList)
async def list_deliveries(
    webhook_id: str,
    svc: DaemonDep,
    who: Auth,
    after: Annotated[int, Query(ge=0, description="deliveries after this id")] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> WebhookDeliveryList:
    """The webhook's deliveries, oldest first, each with its attempts."""
    rows = svc.webhooks.delivery_log(who, webhook_id, after, limit)
    return WebhookDeliveryList(deliveries=[WebhookDelivery.model_validate(r) for r in rows])
