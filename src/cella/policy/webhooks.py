"""Lifecycle webhooks, the pure parts: which sandbox events a webhook is told of, the bodies
it is sent, and how each delivery is signed (and checked, by whoever receives it).

cella's form: a JSON body `{id, type, created_at, sandbox: {id, template, state, labels},
data}` with headers `Cella-Webhook-Id`, `Cella-Delivery-Id`, `Cella-Event`,
`Cella-Timestamp` (unix seconds) and `Cella-Signature: v1=HEX`, where HEX is the
HMAC-SHA256 of `TIMESTAMP.BODY` (the exact bytes sent) under the webhook's secret.
`verify` is the receiver's check (signature and age).

E2B's form (a webhook registered at E2B's `/events/webhooks`): its v2 event body and
headers `e2b-webhook-id`, `e2b-delivery-id`, `e2b-signature-version: v1` and
`e2b-signature`: the SHA-256 of the secret followed by the body, base64 without padding.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from datetime import UTC, datetime
from typing import Any

EVENTS = (
    "sandbox.created",
    "sandbox.updated",
    "sandbox.paused",
    "sandbox.resumed",
    "sandbox.killed",
)
# a sandbox's trace event -> the webhook event it is
FROM_TRACE = {
    "created": "sandbox.created",
    "forked": "sandbox.created",
    "updated": "sandbox.updated",
    "network_changed": "sandbox.updated",
    "access_changed": "sandbox.updated",
    "paused": "sandbox.paused",
    "stopped": "sandbox.paused",
    "resumed": "sandbox.resumed",
    "deleted": "sandbox.killed",
    "crashed": "sandbox.killed",
}
E2B_PREFIX = "sandbox.lifecycle."
MAX_AGE = 300  # seconds a receiver should accept a signed timestamp for


def e2b_event(event: str) -> str:
    """`sandbox.created` as E2B names it (`sandbox.lifecycle.created`)."""
    return E2B_PREFIX + event.removeprefix("sandbox.")


def from_e2b_event(name: str) -> str:
    """E2B's event name as cella's; ValueError when it is none of them."""
    event = "sandbox." + name.removeprefix(E2B_PREFIX)
    if not name.startswith(E2B_PREFIX) or event not in EVENTS:
        raise ValueError(f"unknown event {name!r}")
    return event


def body(
    flavor: str,
    event: str,
    delivery_key: str,
    sandbox: dict[str, Any],
    data: dict[str, Any],
    at: float,
) -> str:
    """The JSON body a webhook of `flavor` is sent for one event."""
    stamp = datetime.fromtimestamp(at, UTC).isoformat().replace("+00:00", "Z")
    if flavor == "e2b":
        payload: dict[str, Any] = {
            "version": "v2",
            "id": delivery_key,
            "type": e2b_event(event),
            "eventData": {"sandbox_metadata": sandbox.get("labels") or {}, **data},
            "sandboxBuildId": "",
            "sandboxExecutionId": sandbox["id"],
            "sandboxId": sandbox["id"],
            "sandboxTeamId": sandbox.get("tenant", ""),
            "sandboxTemplateId": sandbox.get("template", ""),
            "timestamp": stamp,
        }
    else:
        payload = {
            "id": delivery_key,
            "type": event,
            "created_at": stamp,
            "sandbox": {k: sandbox.get(k) for k in ("id", "template", "state", "labels")},
            "data": data,
        }
    return json.dumps(payload, separators=(",", ":"), sort_keys=True)


def signature(secret: str, timestamp: int, payload: bytes) -> str:
    mac = hmac.new(secret.encode(), f"{timestamp}.".encode() + payload, hashlib.sha256)
    return "v1=" + mac.hexdigest()


def e2b_signature(secret: str, payload: bytes) -> str:
    digest = hashlib.sha256(secret.encode() + payload).digest()
    return base64.b64encode(digest).decode().rstrip("=")


def headers(
    flavor: str, secret: str, webhook_id: str, delivery_id: int, event: str, payload: bytes
) -> dict[str, str]:
    """The headers that sign one attempt of a delivery."""
    if flavor == "e2b":
        return {
            "e2b-webhook-id": webhook_id,
            "e2b-delivery-id": str(delivery_id),
            "e2b-signature-version": "v1",
            "e2b-signature": e2b_signature(secret, payload),
        }
    timestamp = int(time.time())
    return {
        "Cella-Webhook-Id": webhook_id,
        "Cella-Delivery-Id": str(delivery_id),
        "Cella-Event": event,
        "Cella-Timestamp": str(timestamp),
        "Cella-Signature": signature(secret, timestamp, payload),
    }


def verify(
    secret: str, payload: bytes, timestamp: str, signed: str, now: float | None = None
) -> bool:
    """A receiver's check of cella's signature: the HMAC matches and the timestamp is at
    most `MAX_AGE` seconds from now."""
    try:
        stamp = int(timestamp)
    except ValueError:
        return False
    if abs((time.time() if now is None else now) - stamp) > MAX_AGE:
        return False
    return hmac.compare_digest(signature(secret, stamp, payload), signed)


def backoff(attempt: int, base: float, ceiling: float = 600.0) -> float:
    """Seconds before try `attempt + 1` after `attempt` failed ones."""
    return float(min(ceiling, base * 2 ** max(0, attempt - 1)))
