"""E2B's control plane (`E2B_API_URL`): sandboxes created from a template or a snapshot,
listed with metadata and state filters and pages, inspected, timed out, paused, connected
(resumed), forked, snapshotted and killed. `timeout` is the sandbox's lifetime from now (300
s when not given, as E2B's API does), after which it is killed, or paused with `autoPause`."""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import time
from datetime import UTC, datetime
from typing import Annotated, Any
from urllib.parse import parse_qsl, unquote

from fastapi import APIRouter, Body, Request, Response
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from cella import errors
from cella.models import (
    ExecDefaults,
    HeaderRule,
    IdentityToken,
    NetworkPolicy,
    SandboxCreate,
    SandboxUpdate,
    SecretPut,
    UpstreamProxy,
)
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
from cella.server.deps import Caller, DaemonDep, IdempotencyKey
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
UNSUPPORTED = ("mcp",)
MAX_FORKS = 100  # E2B's spec (its SDK sends at most 20)


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
async def create(
    svc: DaemonDep, who: Caller, body: JsonBody, idempotency_key: IdempotencyKey = None
) -> Json:
    """E2B's SDK sends no `Idempotency-Key`; a client that does gets one sandbox per key."""
    spec = create_spec(svc, who, body)

    async def make() -> list[str]:
        return [(await svc.create(who, spec)).id]

    ids = await svc.idempotency.once(who.tenant, "e2b.create", idempotency_key, body, make)
    return shown(svc, svc.registry.get(who, ids[0]))


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
    detail = detail_json(row, access(svc, row) if drives else None, disk_of(svc, row))
    if row.volume_mounts:  # by name, as they were asked for
        names = svc.volumes.names(who)
        detail["volumeMounts"] = [
            {"name": names.get(m.volume, m.volume), "path": m.path} for m in row.volume_mounts
        ]
    return detail


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
    upstream = egress_proxy_of(svc, who, body)
    await svc.egress.set_network(who, row.id, network_of(body, row.network, upstream))
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
        if body.get("memory") is False and row.state != "stopped":  # a reboot from its disk
            await svc.lifecycle.stop(who, row.id, memory=False)
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
    if not 1 <= count <= MAX_FORKS:
        raise errors.InvalidArgument(f"count must be 1-{MAX_FORKS}, got {count}")
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
    """A template built from steps (by id or name), or a snapshot: E2B deletes snapshots
    as templates, by id or name."""
    if await svc.template_builds.delete(who.tenant, unquote(ref)):
        return Response(status_code=204)
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
        "ttl_clock": "running",  # paused time is not spent: E2B's timeout is running time
        **lifecycle_of(body),
        "labels": {str(k): str(v) for k, v in metadata.items()},
        "exec_defaults": ExecDefaults(env={str(k): str(v) for k, v in env.items()}),
        "network": network_of(body, upstream=egress_proxy_of(svc, who, body.get("network"))),
        "volume_mounts": volume_mounts(body.get("volumeMounts")),
    }
    template = str(body.get("templateID") or BASE)
    built = svc.template_builds.resolve(who.tenant, template)  # one built with Template
    if built is not None:
        spec["template"] = built.template
        spec |= {"vcpus": built.vcpus} if built.vcpus else {}
        spec |= {"memory_mib": built.memory_mib} if built.memory_mib else {}
    else:
        with contextlib.suppress(errors.NotFound):  # a snapshot stands in for a template
            spec["snapshot"] = svc.snapshots.resolve(who.tenant, template).id
    if "snapshot" not in spec and "template" not in spec:
        spec["template"] = TEMPLATES.get(template, template)
    try:
        return SandboxCreate.model_validate(spec)
    except ValueError as exc:
        problems = getattr(exc, "errors", None)
        raise errors.InvalidArgument(describe(problems()) if problems else str(exc)) from None


def volume_mounts(given: Any) -> list[Json]:
    """`volumeMounts` (`[{name, path}]`) as cella's volume mounts (read-write, as E2B's)."""
    if given is None:
        return []
    if not isinstance(given, list) or not all(isinstance(m, dict) for m in given):
        raise errors.InvalidArgument("volumeMounts must be a list of {name, path}")
    for mount in given:
        if set(mount) - {"name", "path"} or not mount.get("name") or not mount.get("path"):
            raise errors.InvalidArgument("each of volumeMounts is {name, path}")
    return [{"volume": str(m["name"]), "path": str(m["path"])} for m in given]


def lifecycle_of(body: Json) -> Json:
    """`autoPause` (the timeout pauses instead of killing), `autoPauseMemory` (false: the
    pause keeps the disk alone, a stop) and `autoResume` (traffic to the paused sandbox's
    envd or ports resumes it), as E2B's API holds them together."""
    pause = body.get("autoPause") or False
    memory = body.get("autoPauseMemory", True)
    resume = body.get("autoResume") or {}
    if not isinstance(resume, dict) or not isinstance(resume.get("enabled", False), bool):
        raise errors.InvalidArgument('autoResume must be {"enabled": true|false}')
    if not isinstance(pause, bool) or not isinstance(memory, bool):
        raise errors.InvalidArgument("autoPause and autoPauseMemory must be booleans")
    wake = resume.get("enabled", False)
    if wake and not pause:
        raise errors.InvalidArgument("autoResume needs autoPause: only a paused sandbox wakes")
    if wake and not memory:
        raise errors.InvalidArgument(
            "autoResume cannot be combined with autoPauseMemory false: a filesystem-only "
            "pause is resumed explicitly (connect)"
        )
    action = ("pause" if memory else "stop") if pause else "delete"
    return {"ttl_action": action, "auto_resume": wake}


def network_of(
    body: Json, kept: NetworkPolicy | None = None, upstream: UpstreamProxy | None = None
) -> NetworkPolicy:
    """`allow_internet_access`, `network.allowOut`/`denyOut` as egress rules,
    `network.rules` as header rules (`${e2b.identity.tokens.NAME}` in a value: the `iam`
    token NAME, minted by the egress proxy), `maskRequestHost` as the Host its port
    servers see. Without them, cella's default holds: nothing is reachable until allowed.
    `upstream` is its `egressProxy` (`egress_proxy_of`). (An update's body is the `network`
    object itself, with `allow_internet_access` in it; what it cannot carry, public ports,
    the masked host and the `iam` tokens, is `kept`.)"""
    net = (body.get("network") or {}) if kept is None else body
    if not isinstance(net, dict):
        raise errors.InvalidArgument("network must be an object")
    for unsupported in ("dnsServers", "httpsPorts"):
        if net.get(unsupported):
            raise not_supported(f"network.{unsupported}")
    allow = [str(r) for r in net.get("allowOut") or []]
    deny = [str(r) for r in net.get("denyOut") or []]
    if body.get("allow_internet_access") is True:
        allow.append("*")
    if body.get("allow_internet_access") is False:
        allow = [r for r in allow if r != "*"]
    deny = ["*" if r == "0.0.0.0/0" else r for r in deny]  # E2B's "everything else"
    mask = net.get("maskRequestHost")
    if mask is not None and not isinstance(mask, str):
        raise errors.InvalidArgument("network.maskRequestHost must be a string")
    tokens = identity_tokens(body.get("iam")) if kept is None else kept.identity_tokens
    try:
        return NetworkPolicy(
            allow=allow,
            deny=[r for r in deny if r not in allow or r == "*"],
            headers=header_rules(net.get("rules") or {}),
            public_ports=(  # E2B's default: public
                net.get("allowPublicTraffic") is not False if kept is None else kept.public_ports
            ),
            identity_tokens=tokens,
            port_host=(mask or None) if kept is None else kept.port_host,
            upstream_proxy=upstream,
        )
    except ValidationError as exc:
        raise errors.InvalidArgument(describe(exc.errors())) from None


def egress_proxy_of(svc: Daemon, who: Principal, net: Any) -> UpstreamProxy | None:
    """`network.egressProxy` (`{address: "host:port", username, password}`): a SOCKS5 proxy
    of the tenant's own, its password kept as a tenant secret (bound to no host, named by
    its digest), never in the sandbox's network policy."""
    proxy = net.get("egressProxy") if isinstance(net, dict) else None
    if proxy is None:
        return None
    if not isinstance(proxy, dict) or not isinstance(proxy.get("address"), str):
        raise errors.InvalidArgument("network.egressProxy needs an address (host:port)")
    if proxy.get("tls"):
        raise not_supported("network.egressProxy.tls (TLS to the proxy)")
    username, password = proxy.get("username"), proxy.get("password")
    if password is not None and username is None:
        raise errors.InvalidArgument("network.egressProxy: a password needs a username")
    secret = None
    if password is not None:
        digest = hashlib.sha256(f"{proxy['address']}\0{username}\0{password}".encode())
        secret = f"e2b-egress-proxy-{digest.hexdigest()[:24]}"
        try:
            svc.egress.put_secret(who.tenant, secret, SecretPut(value=str(password)))
        except ValidationError as exc:
            raise errors.InvalidArgument(describe(exc.errors())) from None
    try:
        return UpstreamProxy(
            url=f"socks5://{proxy['address']}", username=username, password_secret=secret
        )
    except ValidationError as exc:
        raise errors.InvalidArgument(describe(exc.errors())) from None


def identity_tokens(iam: Any) -> dict[str, IdentityToken]:
    """`iam.tokens` (`{name: {audience, tokenType: "JWT-SVID"}}`): workload identity
    tokens, JWTs signed with the daemon's key (`/.well-known/jwks.json`)."""
    if iam is None:
        return {}
    tokens = iam.get("tokens") if isinstance(iam, dict) else None
    if not isinstance(tokens, dict | None):
        raise errors.InvalidArgument("iam.tokens must be an object of name: token")
    out = {}
    for name, token in (tokens or {}).items():
        if not isinstance(token, dict) or not isinstance(token.get("audience"), str):
            raise errors.InvalidArgument(f"iam.tokens[{name!r}] needs an audience")
        if token.get("tokenType") != "JWT-SVID":
            raise errors.InvalidArgument(
                f"iam.tokens[{name!r}]: tokenType {token.get('tokenType')!r} is not served "
                "(JWT-SVID is)"
            )
        out[str(name)] = IdentityToken(audience=token["audience"])
    return out


def header_rules(rules: Any) -> list[HeaderRule]:
    """`network.rules` (`{host: [{transform: {headers: {name: value}}}]}`) as cella's header
    rules: the egress proxy sets each header on requests to the host, a secret named in its
    value (`${e2b.secrets.NAME}`) put in as the request leaves, never in the sandbox, and a
    workload token (`${e2b.identity.tokens.NAME}`) minted for the request."""
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
