"""E2B's observability calls: a sandbox's metrics over time (`/sandboxes/{id}/metrics`) and
many sandboxes' latest (`/sandboxes/metrics`), its logs (`/v2/sandboxes/{id}/logs` and the
older `/sandboxes/{id}/logs`: cella's trace of the sandbox, its lifecycle, commands,
files and egress decisions, as E2B's structured entries) and lifecycle webhooks
(`/events/webhooks`: E2B's payload and signature, `cella.policy.webhooks`)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Body, Request, Response
from pydantic import ValidationError

from cella import errors
from cella.models import WebhookCreate, WebhookUpdate
from cella.policy import webhooks as policy
from cella.server.compat.e2b.control import int_param
from cella.server.deps import Caller, DaemonDep
from cella.server.error_shapes import describe
from cella.store import EventRecord, MetricRecord, WebhookRecord

Json = dict[str, Any]
JsonBody = Annotated[dict[str, Any], Body()]
LEVELS = ("debug", "info", "warn", "error")
MAX_LOGS = 1000
SCANNED = 10_000  # events read to fill one page of logs
MAX_SEARCH = 256
MAX_IDS = 100

router = APIRouter(include_in_schema=False)


def _stamp(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).isoformat().replace("+00:00", "Z")


def metric_json(m: MetricRecord) -> Json:
    return {
        "timestamp": _stamp(m.at),
        "timestampUnix": int(m.at),
        "cpuCount": m.cpu_count,
        "cpuUsedPct": m.cpu_used_pct,
        "memUsed": m.mem_used,
        "memTotal": m.mem_total,
        "memCache": m.mem_cache,
        "diskUsed": m.disk_used,
        "diskTotal": m.disk_total,
    }


def asked_ids(request: Request) -> list[str]:
    """The `sandbox_ids` of a many-sandbox metrics call (required, at most MAX_IDS)."""
    given = request.query_params.get("sandbox_ids")
    if not given:
        raise errors.InvalidArgument("sandbox_ids is required")
    ids = [i for i in given.split(",") if i]
    if len(ids) > MAX_IDS:
        raise errors.InvalidArgument(f"sandbox_ids: at most {MAX_IDS}")
    return ids


@router.get("/sandboxes/metrics")
async def many_metrics(request: Request, svc: DaemonDep, who: Caller) -> Json:
    latest = svc.metrics.latest(who, asked_ids(request))
    return {"sandboxes": {i: metric_json(m) for i, m in latest.items()}}


@router.get("/sandboxes/{sandbox_id}/metrics")
async def metrics(sandbox_id: str, request: Request, svc: DaemonDep, who: Caller) -> list[Json]:
    q = request.query_params
    start, end = q.get("start"), q.get("end")
    first = int_param(start, 0, "start") if start else None
    last = int_param(end, 0, "end") if end else None
    if (first is not None and first < 0) or (last is not None and last < 0):
        raise errors.InvalidArgument("start and end are unix seconds, not negative")
    try:
        rows = svc.metrics.history(who, sandbox_id, first, last)
    except errors.NotFound:
        raise errors.NotFound(f"sandbox {sandbox_id} not found") from None
    return [metric_json(m) for m in rows]


# -- logs ---------------------------------------------------------------------------------


def level_of(event: EventRecord) -> str:
    kind, data = event.type, event.data
    if kind.endswith("failed") or kind in ("crashed", "agent_broken", "error"):
        return "error"
    if kind == "egress":
        return "debug" if data.get("allowed") else "warn"
    if kind.startswith("limit") or data.get("error"):
        return "warn"
    return "info"


def entry(event: EventRecord) -> Json:
    summary = json.dumps(event.data, separators=(",", ":"), sort_keys=True, default=str)
    message = event.type if summary == "{}" else f"{event.type} {summary[:1000]}"
    fields = {"type": event.type, "eventId": str(event.id)}
    for key, value in event.data.items():
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        fields[str(key)] = text[:1000]
    return {
        "timestamp": event.at,
        "level": level_of(event),
        "message": message,
        "fields": fields,
    }


def _iso_ms(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat()


def _logs(
    svc: Any, who: Any, sandbox_id: str, since_ms: int | None, until_ms: int | None,
    backward: bool, limit: int, level: str | None, search: str | None,
) -> list[Json]:  # fmt: skip
    try:
        events = svc.trace.window(
            who,
            sandbox_id,
            None if since_ms is None else _iso_ms(since_ms),
            None if until_ms is None else _iso_ms(until_ms),
            backward,
            SCANNED,
        )
    except errors.NotFound:
        raise errors.NotFound(f"sandbox {sandbox_id} not found") from None
    floor = LEVELS.index(level) if level else 0
    out: list[Json] = []
    for event in events:
        if len(out) >= limit:
            break
        item = entry(event)
        if LEVELS.index(item["level"]) < floor or (search and search not in item["message"]):
            continue
        out.append(item)
    return out


@router.get("/v2/sandboxes/{sandbox_id}/logs")
async def logs_v2(sandbox_id: str, request: Request, svc: DaemonDep, who: Caller) -> Json:
    q = request.query_params
    cursor = q.get("cursor")
    at = int_param(cursor, 0, "cursor") if cursor else None
    limit = int_param(q.get("limit"), MAX_LOGS, "limit")
    direction = q.get("direction") or "forward"
    level, search = q.get("level") or None, q.get("search") or None
    if (at is not None and at < 0) or not 0 <= limit <= MAX_LOGS:
        raise errors.InvalidArgument(f"cursor must not be negative; limit is 0 to {MAX_LOGS}")
    if direction not in ("forward", "backward"):
        raise errors.InvalidArgument("direction is forward or backward")
    if level is not None and level not in LEVELS:
        raise errors.InvalidArgument(f"level is one of {', '.join(LEVELS)}")
    if search is not None and len(search) > MAX_SEARCH:
        raise errors.InvalidArgument(f"search is at most {MAX_SEARCH} characters")
    backward = direction == "backward"
    since, until = (None, at) if backward else (at, None)
    return {"logs": _logs(svc, who, sandbox_id, since, until, backward, limit, level, search)}


@router.get("/sandboxes/{sandbox_id}/logs")
async def logs_v1(sandbox_id: str, request: Request, svc: DaemonDep, who: Caller) -> Json:
    q = request.query_params
    start = int_param(q.get("start"), 0, "start")
    limit = int_param(q.get("limit"), MAX_LOGS, "limit")
    if start < 0 or limit < 0:
        raise errors.InvalidArgument("start and limit must not be negative")
    items = _logs(svc, who, sandbox_id, start or None, None, False, limit, None, None)
    return {
        "logs": [{"timestamp": i["timestamp"], "line": i["message"]} for i in items],
        "logEntries": items,
    }


# -- webhooks -----------------------------------------------------------------------------


def webhook_json(hook: WebhookRecord) -> Json:
    return {
        "id": hook.id,
        "teamID": hook.tenant,
        "name": hook.name,
        "createdAt": hook.created_at,
        "enabled": hook.enabled,
        "url": hook.url,
        "events": [policy.e2b_event(e) for e in hook.events],
    }


def cella_fields(body: Json, known: tuple[str, ...]) -> Json:
    unknown = sorted(set(body) - set(known))
    if unknown:
        raise errors.InvalidArgument(f"unknown fields: {', '.join(unknown)}")
    out: Json = {k: body[k] for k in ("name", "url", "enabled") if k in body}
    if "events" in body:
        events = body["events"]
        if not isinstance(events, list):
            raise errors.InvalidArgument("events must be a list")
        try:
            out["events"] = [policy.from_e2b_event(str(e)) for e in events]
        except ValueError as exc:
            raise errors.InvalidArgument(str(exc)) from None
    if "signatureSecret" in body:
        out["secret"] = body["signatureSecret"]
    return out


FIELDS = ("name", "url", "enabled", "events", "signatureSecret")


@router.post("/events/webhooks", status_code=201)
async def create_webhook(svc: DaemonDep, who: Caller, body: JsonBody) -> Json:
    try:
        spec = WebhookCreate.model_validate(cella_fields(body, FIELDS))
    except ValidationError as exc:
        raise errors.InvalidArgument(describe(exc.errors())) from None
    return webhook_json(await svc.webhooks.create(who, spec, flavor="e2b"))


@router.get("/events/webhooks")
async def list_webhooks(svc: DaemonDep, who: Caller) -> list[Json]:
    return [webhook_json(h) for h in svc.webhooks.all(who)]


@router.get("/events/webhooks/{webhook_id}")
async def get_webhook(webhook_id: str, svc: DaemonDep, who: Caller) -> Json:
    return webhook_json(svc.webhooks.get(who, webhook_id))


@router.patch("/events/webhooks/{webhook_id}")
async def update_webhook(webhook_id: str, svc: DaemonDep, who: Caller, body: JsonBody) -> Json:
    try:
        spec = WebhookUpdate.model_validate(cella_fields(body, FIELDS))
    except ValidationError as exc:
        raise errors.InvalidArgument(describe(exc.errors())) from None
    return webhook_json(await svc.webhooks.update(who, webhook_id, spec))


@router.delete("/events/webhooks/{webhook_id}")
async def delete_webhook(webhook_id: str, svc: DaemonDep, who: Caller) -> Response:
    svc.webhooks.delete(who, webhook_id)
    return Response(status_code=200)
