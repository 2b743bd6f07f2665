"""What is kept to watch sandboxes from outside: metric samples over time (a bounded history
per sandbox), a tenant's webhooks (their signing secrets sealed like other secrets) and the
log of their deliveries."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cella.store.sealing import Sealer
    from cella.store.sql import Cursor


@dataclass(slots=True)
class MetricRecord:
    sandbox_id: str
    at: float  # unix seconds
    cpu_count: int
    cpu_used_pct: float
    mem_used: int
    mem_total: int
    mem_cache: int
    disk_used: int
    disk_total: int


@dataclass(slots=True)
class WebhookRecord:
    id: str
    tenant: str
    name: str
    url: str
    events: list[str]
    secret: str
    enabled: bool = True
    flavor: str = "cella"  # the payload and signature form: "cella" or "e2b"
    created_at: str = ""
    updated_at: str = ""


@dataclass(slots=True)
class DeliveryRecord:
    id: int
    webhook_id: str
    tenant: str
    sandbox_id: str
    event: str
    body: str
    state: str  # pending, delivered, failed
    next_at: float
    created_at: str
    delivered_at: str | None = None
    attempts: list[dict[str, Any]] = field(default_factory=list)


def now() -> str:
    return datetime.now(UTC).isoformat()


def webhook_owner(tenant: str, webhook_id: str) -> str:
    return f"webhook/{tenant}/{webhook_id}"


class Observations:
    """The tables of metrics, webhooks and deliveries (mixed into `Store`)."""

    if TYPE_CHECKING:

        def _exec(self, sql: str, args: tuple[Any, ...] = ()) -> Cursor: ...

        def _sealing(self) -> Sealer: ...

    # -- metrics ----------------------------------------------------------------------------

    def add_metric(self, sample: MetricRecord, keep: int) -> None:
        """Adds a sample and drops the sandbox's oldest beyond `keep`."""
        self._exec(
            "INSERT INTO sandbox_metrics (sandbox_id, at, cpu_count, cpu_used_pct, mem_used, "
            "mem_total, mem_cache, disk_used, disk_total) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (sample.sandbox_id, sample.at, sample.cpu_count, sample.cpu_used_pct,
             sample.mem_used, sample.mem_total, sample.mem_cache, sample.disk_used,
             sample.disk_total),
        )  # fmt: skip
        self._exec(
            "DELETE FROM sandbox_metrics WHERE sandbox_id = ? AND at < (SELECT at FROM "
            "sandbox_metrics WHERE sandbox_id = ? ORDER BY at DESC LIMIT 1 OFFSET ?)",
            (sample.sandbox_id, sample.sandbox_id, keep - 1),
        )

    def metrics(
        self, sandbox_id: str, start: float | None = None, end: float | None = None
    ) -> list[MetricRecord]:
        sql = "SELECT * FROM sandbox_metrics WHERE sandbox_id = ?"
        args: list[Any] = [sandbox_id]
        if start is not None:
            sql += " AND at >= ?"
            args.append(start)
        if end is not None:
            sql += " AND at <= ?"
            args.append(end)
        rows = self._exec(sql + " ORDER BY at", tuple(args)).fetchall()
        return [MetricRecord(**dict(r)) for r in rows]

    def latest_metrics(self, sandbox_ids: list[str]) -> dict[str, MetricRecord]:
        out = {}
        for sandbox_id in sandbox_ids:
            row = self._exec(
                "SELECT * FROM sandbox_metrics WHERE sandbox_id = ? ORDER BY at DESC LIMIT 1",
                (sandbox_id,),
            ).fetchone()
            if row is not None:
                out[sandbox_id] = MetricRecord(**dict(row))
        return out

    def drop_metrics(self, sandbox_id: str) -> None:
        self._exec("DELETE FROM sandbox_metrics WHERE sandbox_id = ?", (sandbox_id,))

    # -- webhooks ---------------------------------------------------------------------------

    def put_webhook(self, hook: WebhookRecord) -> WebhookRecord:
        """Inserts the webhook, or replaces the one with its id (created_at kept)."""
        hook.updated_at = now()
        hook.created_at = hook.created_at or hook.updated_at
        sealed = self._sealing().seal(hook.secret, webhook_owner(hook.tenant, hook.id))
        self._exec(
            "INSERT INTO webhooks (id, tenant, name, url, events, enabled, flavor, value, "
            "created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) "
            "DO UPDATE SET name = excluded.name, url = excluded.url, events = excluded.events, "
            "enabled = excluded.enabled, value = excluded.value, "
            "updated_at = excluded.updated_at",
            (hook.id, hook.tenant, hook.name, hook.url, json.dumps(hook.events),
             int(hook.enabled), hook.flavor, sealed, hook.created_at, hook.updated_at),
        )  # fmt: skip
        return hook

    def get_webhook(self, tenant: str, webhook_id: str) -> WebhookRecord | None:
        row = self._exec(
            "SELECT * FROM webhooks WHERE tenant = ? AND id = ?", (tenant, webhook_id)
        ).fetchone()
        return self._webhook(row) if row else None

    def list_webhooks(self, tenant: str | None) -> list[WebhookRecord]:
        """The tenant's webhooks (None: every tenant's)."""
        if tenant is None:
            rows = self._exec("SELECT * FROM webhooks ORDER BY created_at, id").fetchall()
        else:
            rows = self._exec(
                "SELECT * FROM webhooks WHERE tenant = ? ORDER BY created_at, id", (tenant,)
            ).fetchall()
        return [self._webhook(r) for r in rows]

    def delete_webhook(self, tenant: str, webhook_id: str) -> bool:
        cur = self._exec("DELETE FROM webhooks WHERE tenant = ? AND id = ?", (tenant, webhook_id))
        self._exec("DELETE FROM webhook_deliveries WHERE webhook_id = ?", (webhook_id,))
        return cur.rowcount > 0

    def _webhook(self, row: Any) -> WebhookRecord:
        data = dict(row)
        sealed = data.pop("value")
        secret = self._sealing().open(sealed, webhook_owner(row["tenant"], row["id"]))
        data.update(events=json.loads(data["events"]), enabled=bool(data["enabled"]))
        return WebhookRecord(**data, secret=secret)

    def sealed_webhooks(self) -> list[tuple[str, str, str]]:
        """(id, owner, sealed secret) of every webhook, for a key's check and rotation."""
        rows = self._exec("SELECT id, tenant, value FROM webhooks").fetchall()
        return [(r["id"], webhook_owner(r["tenant"], r["id"]), r["value"]) for r in rows]

    # -- deliveries -------------------------------------------------------------------------

    def add_delivery(self, hook: WebhookRecord, sandbox_id: str, event: str, body: str) -> int:
        cur = self._exec(
            "INSERT INTO webhook_deliveries (webhook_id, tenant, sandbox_id, event, body, "
            "state, next_at, created_at) VALUES (?, ?, ?, ?, ?, 'pending', ?, ?)",
            (hook.id, hook.tenant, sandbox_id, event, body, time.time(), now()),
        )
        return int(cur.lastrowid or 0)

    def pending_heads(self) -> list[DeliveryRecord]:
        """The oldest pending delivery of each webhook and sandbox (the next to send)."""
        rows = self._exec(
            "SELECT * FROM webhook_deliveries WHERE id IN (SELECT MIN(id) FROM "
            "webhook_deliveries WHERE state = 'pending' GROUP BY webhook_id, sandbox_id) "
            "ORDER BY id"
        ).fetchall()
        return [_delivery(r) for r in rows]

    def update_delivery(self, delivery: DeliveryRecord) -> None:
        self._exec(
            "UPDATE webhook_deliveries SET state = ?, attempts = ?, next_at = ?, "
            "delivered_at = ? WHERE id = ?",
            (delivery.state, json.dumps(delivery.attempts), delivery.next_at,
             delivery.delivered_at, delivery.id),
        )  # fmt: skip

    def deliveries(
        self, tenant: str, webhook_id: str, after: int = 0, limit: int = 100
    ) -> list[DeliveryRecord]:
        rows = self._exec(
            "SELECT * FROM webhook_deliveries WHERE tenant = ? AND webhook_id = ? AND id > ? "
            "ORDER BY id LIMIT ?",
            (tenant, webhook_id, after, limit),
        ).fetchall()
        return [_delivery(r) for r in rows]

    def trim_deliveries(self, keep: int) -> None:
        """Keeps each webhook's newest `keep` finished deliveries."""
        self._exec(
            "DELETE FROM webhook_deliveries WHERE state != 'pending' AND id NOT IN (SELECT id "
            "FROM (SELECT id, ROW_NUMBER() OVER (PARTITION BY webhook_id ORDER BY id DESC) AS n "
            "FROM webhook_deliveries WHERE state != 'pending') WHERE n <= ?)",
            (keep,),
        )


def _delivery(row: Any) -> DeliveryRecord:
    return DeliveryRecord(**{**dict(row), "attempts": json.loads(row["attempts"])})
