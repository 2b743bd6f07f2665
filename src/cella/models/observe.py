"""Watching sandboxes on the wire: metric samples over time, lifecycle webhooks and their
deliveries."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from cella.models.keys import TENANT

WebhookEvent = Literal[
    "sandbox.created", "sandbox.updated", "sandbox.paused", "sandbox.resumed", "sandbox.killed"
]
ALL_EVENTS: list[WebhookEvent] = [
    "sandbox.created",
    "sandbox.updated",
    "sandbox.paused",
    "sandbox.resumed",
    "sandbox.killed",
]


class MetricSample(BaseModel):
    """One sample of a running sandbox: CPU from the host (its VM's CPU time), memory and
    disk from inside the guest."""

    at: float = Field(description="unix seconds")
    cpu_count: int
    cpu_used_pct: float = Field(description="of all the sandbox's vCPUs, 0-100")
    mem_used: int = Field(description="bytes")
    mem_total: int = Field(description="bytes")
    mem_cache: int = Field(description="bytes of page cache")
    disk_used: int = Field(description="bytes")
    disk_total: int = Field(description="bytes")


class MetricList(BaseModel):
    metrics: list[MetricSample]


class WebhookCreate(BaseModel):
    """A URL told of the tenant's sandboxes' lifecycle events, each delivery signed."""

    model_config = {"extra": "forbid"}

    name: str = Field(default="", max_length=128)
    url: str = Field(min_length=1, max_length=2048, description="http(s) URL the events go to")
    events: list[WebhookEvent] = Field(default_factory=lambda: list(ALL_EVENTS), min_length=1)
    enabled: bool = True
    secret: str | None = Field(
        default=None,
        min_length=16,
        max_length=256,
        description="the HMAC key deliveries are signed with (made when not given)",
    )


class WebhookUpdate(BaseModel):
    """Fields given replace the webhook's."""

    model_config = {"extra": "forbid"}

    name: str | None = Field(default=None, max_length=128)
    url: str | None = Field(default=None, min_length=1, max_length=2048)
    events: list[WebhookEvent] | None = Field(default=None, min_length=1)
    enabled: bool | None = None
    secret: str | None = Field(default=None, min_length=16, max_length=256)


class SharedWebhook(BaseModel):
    """A webhook a fleet gateway keeps, as it gives it to each node (its id in the path)."""

    model_config = {"extra": "forbid"}

    tenant: str = Field(pattern=TENANT)
    name: str = Field(default="", max_length=128)
    url: str = Field(min_length=1, max_length=2048)
    events: list[WebhookEvent] = Field(min_length=1)
    secret: str = Field(min_length=1, max_length=256)
    enabled: bool = True
    flavor: Literal["cella", "e2b"] = "cella"


class Webhook(BaseModel):
    model_config = {"from_attributes": True}

    id: str
    name: str
    url: str
    events: list[WebhookEvent]
    enabled: bool
    created_at: str
    updated_at: str


class WebhookCreated(Webhook):
    secret: str = Field(description="shown once: the key a receiver verifies deliveries with")


class WebhookList(BaseModel):
    webhooks: list[Webhook]


class WebhookAttempt(BaseModel):
    at: str
    status: int | None = Field(default=None, description="the receiver's HTTP status")
    error: str | None = None
    duration_ms: float


class WebhookDelivery(BaseModel):
    model_config = {"from_attributes": True}

    id: int
    sandbox_id: str
    event: str
    state: Literal["pending", "delivered", "failed"]
    created_at: str
    delivered_at: str | None = None
    attempts: list[WebhookAttempt]
    body: str = Field(description="the exact JSON sent")


class WebhookDeliveryList(BaseModel):
    deliveries: list[WebhookDelivery]
