"""E2B's control plane (`E2B_API_URL`): sandboxes created from a template or a snapshot,
listed with metadata and state filters and pages, inspected, timed out, paused, connected
(resumed), forked, snapshotted and killed. `timeout` is the sandbox's lifetime from now (300
s when not given, as E2B's API does), after which it is killed, or paused with `autoPause`."""

from __future__ import annotations

import base64
import binascii
import contextlib
import time
from datetime import UTC, datetime
from typing import Annotated, Any
from urllib.parse import parse_qsl, unquote

from fastapi import APIRouter, Body, Request, Response
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from cella import errors
from cella.models import ExecDefaults, HeaderRule, NetworkPolicy, SandboxCreate, SandboxUpdate
from cella.models.sandbox import MAX_LIFETIME_SECONDS
from cella.policy.access import Permission
from cella.server.compat.e2b.shapes import (
    BASE,
    Access,
    as_cella_refs,
    detail_json,
    sandbox_json,
    started_at,
    state_of,
)
from cella.server.deps import Caller, DaemonDep
from cella.server.error_shapes import describe
from cella.service.daemon import Daemon
from cella.service.keys import Principal
from cella.store import SandboxRecord

Json = dict[str, Any]
JsonBody = Annotated[dict[str, Any], Body()]
MaybeBody = Annotated[dict[str, Any] | None, Body()]
DEFAULT_TIMEOUT = 300  # E2B's API default lifetime, in seconds
REFRESH_MIN, REFRESH_MAX = 15, 3600  # a refresh's duration: E2B's floor, its spec's ceiling
TEMPLATES = {BASE: "default", "code-interpreter-v1": "code-interpreter"}  # E2B's names
UNSUPPORTED = ("mcp", "iam", "volumeMounts", "autoResume")


def not_supported(what: str) -> errors.CellaError:
    return errors.InvalidArgument(f"not supported by cella: {what}")


router = APIRouter(include_in_schema=False)


def access(svc: Daemon, row: SandboxRecord) -> Access:
    # every sandbox has a traffic token, public or not: it is all E2B's code
    # interpreter SDK sends with its `/contexts` calls
    traffic = svc.ports.traffic_token(row.id)
    return Access(svc.ports.access_token(row.id), traffic, svc.settings.ports_domain)


def shown(svc: Daemon, row: SandboxRecord) -> Json:
    return sandbox_json(row, access(svc, row))


def sandbox(
    svc: Daemon, who: Principal, sandbox_id: str, need: Permission = Permission.view
) -> SandboxRecord:
    try:
        return svc.registry.get(who, sandbox_id, need)
    except errors.NotFound:
        raise errors.NotFound(f"sandbox {sandbox_id} not found") from None


@router.post("/v2/sandboxes", status_code=201)
@router.post("/sandboxes", status_code=201)
async def create(svc: DaemonDep, who: Caller, body: JsonBody) -> Json:
    spec = create_spec(svc, who, body)
    return shown(svc, await svc.create(who, spec))


@router.get("/v2/sandboxes")
@router.get("/sandboxes")
async def list_sandboxes(request: Request, svc: DaemonDep, who: Caller) -> Response:
    q = request.query_params
    rows = [r for r in svc.registry.find(who) if r.state not in ("deleting", "error")]
    wanted = metadata_filter(q.get("metadata"))
    rows = [r for r in rows if all(r.labels.get(k) == v for k, v in wanted.items())]
    if states := q.get("state"):
        rows = [r for r in rows if state_of(r) in states.split(",")]
    if template := q.get("template"):
        rows = [r for r in rows if template in (r.template, r.template == "default" and BASE)]
    if after := q.get("startedAfter"):
        since = timestamp_param(after, "startedAfter")
        rows = [r for r in rows if started_at(r) >= since]
    if q.get("order") == "desc":
        rows.reverse()
    start = page_start(q.get("nextToken"))
    limit = int_param(q.get("limit"), 100, "limit")
    page = rows[start : start + limit]
    headers = {}
    if start + limit < len(rows):
        headers["X-Next-Token"] = base64.urlsafe_b64encode(str(start + limit).encode()).decode()
    listed = []
    for r in page:
        listed.append(detail_json(r, None, disk_of(svc, r)))
    return JSONResponse(listed, headers=headers)


@router.get("/sandboxes/{sandbox_id}")
async def get(sandbox_id: str, svc: DaemonDep, who: Caller) -> Json:
    row = sandbox(svc, who, sandbox_id)
    # the envd tokens open its commands and files: only to a key that may exec in it
    drives = svc.registry.permission(who, row) in (Permission.exec, Permission.manage)
    return detail_json(row, access(svc, row) if drives else None, disk_of(svc, row))


@router.delete("/sandboxes/{sandbox_id}", status_code=204)
async def kill(sandbox_id: str, svc: DaemonDep, who: Caller) -> Response:
    sandbox(svc, who, sandbox_id)
    await svc.lifecycle.delete(who, sandbox_id)
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/timeout", status_code=204)
async def set_timeout(sandbox_id: str, svc: DaemonDep, who: Caller, body: JsonBody) -> Response:
    row = sandbox(svc, who, sandbox_id, Permission.manage)
    await svc.lifecycle.update(who, row.id, ttl_seconds=lifetime(row, body))
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/refreshes", status_code=204)
async def refresh(sandbox_id: str, svc: DaemonDep, who: Caller, body: MaybeBody = None) -> Response:
    """Keeps the sandbox alive at least `duration` seconds from now (15 when not given or
    less, as E2B's API does); unlike `set_timeout`, never shortens its lifetime."""
    row = sandbox(svc, who, sandbox_id)
    duration = int_param((body or {}).get("duration"), REFRESH_MIN, "duration")
    if duration > REFRESH_MAX:
        raise errors.InvalidArgument(f"duration must be at most {REFRESH_MAX} seconds")
    wanted = lifetime(row, {"timeout": max(duration, REFRESH_MIN)})
    if row.ttl_seconds is not None and wanted > row.ttl_seconds:
        await svc.lifecycle.update(who, row.id, ttl_seconds=wanted)
    return Response(status_code=204)


@router.put("/sandboxes/{sandbox_id}/network", status_code=204)
async def update_network(sandbox_id: str, svc: DaemonDep, who: Caller, body: JsonBody) -> Response:
    """Replaces the sandbox's egress rules (what is omitted is cleared, as E2B's API does);
    a running sandbox has them for its next connection."""
    row = sandbox(svc, who, sandbox_id)
    await svc.egress.set_network(who, row.id, network_of(body, row.network.public_ports))
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/pause", status_code=204)
async def pause(sandbox_id: str, svc: DaemonDep, who: Caller, body: MaybeBody = None) -> Response:
    row = sandbox(svc, who, sandbox_id)
    if state_of(row) == "paused":
        raise errors.InvalidState(f"sandbox {sandbox_id} is already paused")
    if (body or {}).get("memory") is False:  # the filesystem only: a stop
        await svc.lifecycle.stop(who, row.id)
    else:
        await svc.lifecycle.pause(who, row.id)
    return Response(status_code=204)


@router.post("/v2/sandboxes/{sandbox_id}/connect")
@router.post("/sandboxes/{sandbox_id}/connect")
@router.post("/sandboxes/{sandbox_id}/resume")
async def connect(sandbox_id: str, svc: DaemonDep, who: Caller, body: MaybeBody = None) -> Response:
    """200 if it was running, 201 if it was resumed (paused or stopped). Its lifetime is
    changed only for a key that manages it (one that may exec in it connects as it is)."""
    body = body or {}
    row = sandbox(svc, who, sandbox_id, Permission.exec)  # its answer holds the envd tokens
    manages = svc.registry.permission(who, row) == Permission.manage
    status = 200
    if state_of(row) == "paused":  # resumed with a fresh lifetime, as E2B does
        row = await svc.lifecycle.resume(who, row.id)
        if manages:
            row = await svc.lifecycle.update(who, row.id, ttl_seconds=lifetime(row, body))
        status = 201
    elif manages and body.get("timeout") is not None and row.ttl_seconds is not None:
        longer = max(lifetime(row, body), row.ttl_seconds)  # only ever extended
        row = await svc.lifecycle.update(who, row.id, ttl_seconds=longer)
    return JSONResponse(shown(svc, row), status_code=status)


@router.post("/sandboxes/{sandbox_id}/fork", status_code=201)
async def fork(sandbox_id: str, svc: DaemonDep, who: Caller, body: MaybeBody = None) -> list[Json]:
    body = body or {}
    sandbox(svc, who, sandbox_id)
    count = int_param(body.get("count"), 1, "count")
    if not 1 <= count <= 20:
        raise errors.InvalidArgument("count must be 1-20")
    rows = await svc.forks.fork(who, sandbox_id, count)
    if body.get("timeout") is not None:
        rows = [await svc.lifecycle.update(who, r.id, ttl_seconds=lifetime(r, body)) for r in rows]
    return [{"sandbox": shown(svc, r)} for r in rows]


@router.post("/sandboxes/{sandbox_id}/snapshots", status_code=201)
async def snapshot(sandbox_id: str, svc: DaemonDep, who: Caller, body: MaybeBody = None) -> Json:
    body = body or {}
    sandbox(svc, who, sandbox_id)
    memory = body.get("memory", True)
    if not isinstance(memory, bool):
        raise errors.InvalidArgument("memory must be a boolean")
    name = str(body.get("name") or f"snapshot-of-{sandbox_id}")
    # memory false: the filesystem alone; sandboxes made from it boot from its disk
    snap = await svc.snapshots.snapshot(who, sandbox_id, name, "latest", memory=memory)
    return {"snapshotID": snap.id, "names": [name]}


@router.get("/snapshots")
async def list_snapshots(request: Request, svc: DaemonDep, who: Caller) -> Response:
    q = request.query_params
    rows = [s for s in svc.snapshots.find(who.tenant) if s.state == "ready"]
    if source := q.get("sandboxID"):
        rows = [s for s in rows if s.sandbox_id == source]
    if name := q.get("name"):
        rows = [s for s in rows if s.name == name]
    start = page_start(q.get("nextToken"))
    limit = int_param(q.get("limit"), 100, "limit")
    headers = {}
    if start + limit < len(rows):
        headers["X-Next-Token"] = base64.urlsafe_b64encode(str(start + limit).encode()).decode()
    page = [{"snapshotID": s.id, "names": [s.name]} for s in rows[start : start + limit]]
    return JSONResponse(page, headers=headers)


@router.delete("/templates/{ref:path}", status_code=204)
async def delete_snapshot(ref: str, svc: DaemonDep, who: Caller) -> Response:
    """E2B deletes snapshots as templates: by id or name."""
    snap = svc.snapshots.resolve(who.tenant, unquote(ref))
    await svc.snapshots.delete(who.tenant, snap.id)
    return Response(status_code=204)


def create_spec(svc: Daemon, who: Principal, body: Json) -> SandboxCreate:
    """An E2B create as a cella create; what cella cannot honour is refused by name."""
    for unsupported in UNSUPPORTED:
        if body.get(unsupported):
            raise not_supported(unsupported)
    timeout = int_param(body.get("timeout"), DEFAULT_TIMEOUT, "timeout")
    if timeout < 1:
        raise errors.InvalidArgument("timeout must be at least 1 second")
    metadata = body.get("metadata") or {}
    env = body.get("envVars") or {}
    if not isinstance(metadata, dict) or not isinstance(env, dict):
        raise errors.InvalidArgument("metadata and envVars must be objects of strings")
    spec: Json = {
        "ttl_seconds": timeout,
        "ttl_action": "pause" if body.get("autoPause") else "delete",
        "labels": {str(k): str(v) for k, v in metadata.items()},
        "exec_defaults": ExecDefaults(env={str(k): str(v) for k, v in env.items()}),
        "network": network_of(body),
    }
    template = str(body.get("templateID") or BASE)
    with contextlib.suppress(errors.NotFound):  # a snapshot stands in for a template
        spec["snapshot"] = svc.snapshots.resolve(who.tenant, template).id
    if "snapshot" not in spec:
        spec["template"] = TEMPLATES.get(template, template)
    try:
        return SandboxCreate.model_validate(spec)
    except ValueError as exc:
        problems = getattr(exc, "errors", None)
        raise errors.InvalidArgument(describe(problems()) if problems else str(exc)) from None


def network_of(body: Json, public_ports: bool | None = None) -> NetworkPolicy:
    """`allow_internet_access`, `network.allowOut`/`denyOut` as egress rules and
    `network.rules` as header rules. Without them, cella's default holds: nothing is
    reachable until allowed. (An update's body is the `network` object itself, with
    `allow_internet_access` in it; `public_ports` is then the sandbox's, kept.)"""
    net = (body.get("network") or {}) if public_ports is None else body
    if not isinstance(net, dict):
        raise errors.InvalidArgument("network must be an object")
    for unsupported in ("egressProxy", "dnsServers", "maskRequestHost", "httpsPorts"):
        if net.get(unsupported):
            raise not_supported(f"network.{unsupported}")
    allow = [str(r) for r in net.get("allowOut") or []]
    deny = [str(r) for r in net.get("denyOut") or []]
    if body.get("allow_internet_access") is True:
        allow.append("*")
    if body.get("allow_internet_access") is False:
        allow = [r for r in allow if r != "*"]
    deny = ["*" if r == "0.0.0.0/0" else r for r in deny]  # E2B's "everything else"
    try:
        return NetworkPolicy(
            allow=allow,
            deny=[r for r in deny if r not in allow or r == "*"],
            headers=header_rules(net.get("rules") or {}),
            public_ports=(  # E2B's default: public
                net.get("allowPublicTraffic") is not False if public_ports is None else public_ports
            ),
        )
    except ValidationError as exc:
        raise errors.InvalidArgument(describe(exc.errors())) from None


def header_rules(rules: Any) -> list[HeaderRule]:
    """`network.rules` (`{host: [{transform: {headers: {name: value}}}]}`) as cella's header
    rules: the egress proxy sets each header on requests to the host, a secret named in its
    value (`${e2b.secrets.NAME}`) put in as the request leaves, never in the sandbox."""
    if not isinstance(rules, dict):
        raise errors.InvalidArgument("network.rules must be an object of host: [rule]")
    out = []
    for host, entries in rules.items():
        if not isinstance(entries, list):
            raise errors.InvalidArgument(f"network.rules[{host!r}] must be a list of rules")
        for entry in entries:
            transform = entry.get("transform") if isinstance(entry, dict) else None
            if not isinstance(transform, dict) or set(entry) - {"transform"}:
                raise errors.InvalidArgument(f"network.rules[{host!r}]: each rule is a transform")
            if set(transform) - {"headers"}:
                raise not_supported(f"network.rules transforms other than headers ({host})")
            headers = transform.get("headers") or {}
            if not isinstance(headers, dict):
                raise errors.InvalidArgument(f"network.rules[{host!r}]: headers is an object")
            for name, value in headers.items():
                if "${e2b.identity." in str(value):
                    raise not_supported("workload identity tokens in network.rules (iam)")
                out.append(HeaderRule(hosts=[host], name=name, value=as_cella_refs(str(value))))
    return out


def lifetime(row: SandboxRecord, body: Json) -> int:
    """`timeout` seconds from now, as a lifetime counted from the sandbox's creation (held
    to the bound a create has)."""
    seconds = int_param(body.get("timeout"), DEFAULT_TIMEOUT, "timeout")
    if seconds < 1:
        raise errors.InvalidArgument("timeout must be at least 1 second")
    age = int(row.age_seconds(time.time()))
    try:
        change = SandboxUpdate(ttl_seconds=age + seconds)
    except ValidationError:
        raise errors.InvalidArgument(
            f"timeout {seconds} s is too long: a sandbox lives at most {MAX_LIFETIME_SECONDS} s "
            f"from its creation, and this one is {age} s old"
        ) from None
    assert change.ttl_seconds is not None
    return change.ttl_seconds


def metadata_filter(raw: str | None) -> dict[str, str]:
    """The SDK sends `metadata=` as a URL-encoded query of URL-encoded keys and values."""
    if not raw:
        return {}
    return {unquote(k): unquote(v) for k, v in parse_qsl(raw, keep_blank_values=True)}


def timestamp_param(value: str, name: str) -> datetime:
    """An RFC 3339 time (the SDK sends `isoformat()`, with its offset); one without an
    offset is UTC."""
    try:
        stamp = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise errors.InvalidArgument(f"{name} must be an RFC 3339 time") from None
    return stamp if stamp.tzinfo else stamp.replace(tzinfo=UTC)


def page_start(token: str | None) -> int:
    if not token:
        return 0
    try:
        return int(base64.urlsafe_b64decode(token.encode()).decode())
    except (ValueError, binascii.Error):
        raise errors.InvalidArgument("nextToken is not one this server gave") from None


def int_param(value: Any, default: int, name: str) -> int:
    if value is None or value == "":
        return default
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: infinity
        raise errors.InvalidArgument(f"{name} must be an integer") from None


def disk_of(svc: Daemon, row: SandboxRecord) -> int:
    with contextlib.suppress(errors.CellaError):
        return svc.templates.disk_mib(row.template)
    return 0
