"""E2B's template build API (what the SDK's `Template.build` calls), on cella's templates
built from steps (`service/template_builds.py`): a build requested by name (`/v3/templates`),
its files uploaded by hash to a signed link on the daemon, started with its base, steps,
start and ready commands (`/v2/templates/{id}/builds/{build}`), polled with its log
(`.../status`, `.../logs`); tags, aliases, listing and removal. A sandbox is created from
such a template by its name, `name:tag` or id. What cella cannot honour is refused by name.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from cella import errors
from cella.models import BuildStep, SandboxCreate, StartCommand, StepBuild
from cella.server.compat.e2b.control import Json, JsonBody, int_param, not_supported
from cella.server.compat.e2b.shapes import ENVD_VERSION, iso
from cella.server.deps import Caller, DaemonDep
from cella.server.error_shapes import describe
from cella.service.daemon import Daemon
from cella.store import NamedTemplateRecord, TemplateBuildRecord

router = APIRouter(include_in_schema=False)
REQUEST_FIELDS = {"name", "alias", "tags", "cpuCount", "memoryMB", "minFreeDiskMb"}
START_FIELDS = {"fromImage", "fromTemplate", "fromImageRegistry", "force", "steps", "startCmd",
                "readyCmd"}  # fmt: skip
STEP_FIELDS = {"type", "args", "filesHash", "force"}
STATES = {"waiting": "waiting", "building": "building", "ready": "ready", "error": "error"}
UPLOADS = "/v1/templates/uploads"


def _unknown(body: Json, known: set[str], where: str) -> None:
    if extra := sorted(set(body) - known):
        raise not_supported(f"{where} {', '.join(extra)}")


@router.post("/v3/templates", status_code=202)
async def request_build(body: JsonBody, svc: DaemonDep, who: Caller) -> Json:
    _unknown(body, REQUEST_FIELDS, "template build requests with")
    name = body.get("name") or body.get("alias")
    if not isinstance(name, str) or not name:
        raise errors.InvalidArgument("name is required")
    tags = body.get("tags") or []
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise errors.InvalidArgument("tags must be a list of strings")
    free = body.get("minFreeDiskMb")
    free = None if free is None else int_param(free, 0, "minFreeDiskMb")
    vcpus = body.get("cpuCount")
    memory = body.get("memoryMB")
    if vcpus is not None or memory is not None:
        try:  # held to a create's bounds now, not when the first sandbox is made
            SandboxCreate.model_validate(
                {k: v for k, v in (("vcpus", vcpus), ("memory_mib", memory)) if v is not None}
            )
        except ValidationError as exc:
            raise errors.InvalidArgument(describe(exc.errors())) from None
    named, build, wanted = svc.template_builds.request(who.tenant, name, tags, vcpus, memory, free)
    return {
        "templateID": named.id,
        "buildID": build.id,
        "public": False,
        "names": [named.name],
        "aliases": [named.name],
        "tags": wanted,
    }


@router.get("/templates/{template_id}/files/{files_hash}", status_code=201)
async def upload_link(
    template_id: str, files_hash: str, request: Request, svc: DaemonDep, who: Caller
) -> Json:
    """Whether the files are here, and a signed link (an hour) that uploads them."""
    present, token = svc.template_builds.upload_token(who.tenant, template_id, files_hash)
    base = str(request.base_url).rstrip("/")
    named = svc.template_builds.named(who.tenant, template_id)
    return {"present": present, "url": f"{base}{UPLOADS}/{named.id}/{files_hash}?token={token}"}


@router.post("/v2/templates/{template_id}/builds/{build_id}", status_code=202)
async def start_build(
    template_id: str, build_id: str, body: JsonBody, svc: DaemonDep, who: Caller
) -> Response:
    spec, credentials = build_spec(body)
    svc.template_builds.start(who.tenant, template_id, build_id, spec, credentials)
    return Response(status_code=202)


def build_spec(body: Json) -> tuple[StepBuild, str | None]:
    """E2B's `TemplateBuildStartV2` as cella's `StepBuild` (and a registry's credentials,
    kept for the build alone)."""
    _unknown(body, START_FIELDS, "template builds with")
    credentials = None
    registry = body.get("fromImageRegistry")
    if registry:
        kind = registry.get("type") if isinstance(registry, dict) else None
        if kind != "registry":
            raise not_supported(f"fromImageRegistry of type {kind!r} (a username and password "
                                "for the registry are)")  # fmt: skip
        user, password = registry.get("username"), registry.get("password")
        if not isinstance(user, str) or not isinstance(password, str) or not user or ":" in user:
            raise errors.InvalidArgument("fromImageRegistry needs a username and a password")
        credentials = f"{user}:{password}"
    steps = []
    for index, raw in enumerate(body.get("steps") or []):
        if not isinstance(raw, dict):
            raise errors.InvalidArgument(f"step {index} is not an object")
        _unknown(raw, STEP_FIELDS, f"step {index} with")
        kind = str(raw.get("type", "")).lower()
        if kind not in ("run", "copy", "env", "workdir", "user"):
            raise not_supported(f"template build steps of type {raw.get('type')!r} (step {index})")
        steps.append({"type": kind, "args": raw.get("args") or [],
                      "files_hash": raw.get("filesHash")})  # fmt: skip
    start = None
    if body.get("startCmd") or body.get("readyCmd"):
        start = {"command": body.get("startCmd") or None, "ready": body.get("readyCmd") or None}
    try:
        spec = StepBuild(
            from_image=body.get("fromImage") or None,
            from_template=body.get("fromTemplate") or None,
            steps=[BuildStep.model_validate(s) for s in steps],
            start=StartCommand.model_validate(start) if start else None,
        )
    except ValidationError as exc:
        raise errors.InvalidArgument(describe(exc.errors())) from None
    return spec, credentials


@router.get("/templates/{template_id}/builds/{build_id}/status")
async def build_status(
    template_id: str, build_id: str, request: Request, svc: DaemonDep, who: Caller
) -> Json:
    q = request.query_params
    row = svc.template_builds.build(who.tenant, template_id, build_id)
    logs = svc.template_builds.logs(row)
    offset = int_param(q.get("logsOffset"), 0, "logsOffset")
    limit = int_param(q.get("limit"), 100, "limit")
    if offset < 0 or not 0 <= limit <= 100:
        raise errors.InvalidArgument("logsOffset is at least 0 and limit 0-100")
    entries = _at_least(logs, q.get("level"))
    status: Json = {
        "templateID": row.template_id,
        "buildID": row.id,
        "status": STATES.get(row.state, "error"),
        "logs": [],
        "logEntries": entries[offset : offset + limit],
    }
    if row.state == "error":
        status["reason"] = {
            "message": row.error or "the build failed",
            "step": row.step or "base",
            "logEntries": entries[-20:],
        }
    return status


@router.get("/templates/{template_id}/builds/{build_id}/logs")
async def build_logs(
    template_id: str, build_id: str, request: Request, svc: DaemonDep, who: Caller
) -> Json:
    """The log from `cursor` (milliseconds since the epoch), forward or backward."""
    q = request.query_params
    row = svc.template_builds.build(who.tenant, template_id, build_id)
    if q.get("source") not in (None, "", "persistent", "temporary"):
        raise errors.InvalidArgument("source is persistent or temporary")
    entries = _at_least(svc.template_builds.logs(row), q.get("level"))
    limit = int_param(q.get("limit"), 100, "limit")
    cursor = int_param(q.get("cursor"), 0, "cursor")
    if q.get("direction") == "backward":
        entries = [e for e in entries if not cursor or _ms(e) <= cursor][::-1]
    else:
        entries = [e for e in entries if _ms(e) >= cursor]
    return {"logs": entries[: max(0, min(limit, 100))]}


LEVELS = ["debug", "info", "warn", "error"]


def _at_least(entries: list[dict[str, str]], level: str | None) -> list[dict[str, str]]:
    if not level:
        return entries
    if level not in LEVELS:
        raise errors.InvalidArgument(f"level is one of {LEVELS}")
    return [e for e in entries if LEVELS.index(e["level"]) >= LEVELS.index(level)]


def _ms(entry: dict[str, str]) -> int:
    return int(datetime.fromisoformat(entry["timestamp"].replace("Z", "+00:00")).timestamp() * 1000)


@router.post("/templates/tags", status_code=201)
async def assign_tags(body: JsonBody, svc: DaemonDep, who: Caller) -> Json:
    target, tags = body.get("target"), body.get("tags")
    if not isinstance(target, str) or not isinstance(tags, list) or not tags:
        raise errors.InvalidArgument("target (name:tag) and tags are required")
    build_id, assigned = svc.template_builds.assign(who.tenant, target, [str(t) for t in tags])
    return {"buildID": build_id, "tags": assigned}


@router.delete("/templates/tags", status_code=204)
async def remove_tags(body: JsonBody, svc: DaemonDep, who: Caller) -> Response:
    name, tags = body.get("name"), body.get("tags")
    if not isinstance(name, str) or not isinstance(tags, list) or not tags:
        raise errors.InvalidArgument("name and tags are required")
    await svc.template_builds.remove_tags(who.tenant, name, [str(t) for t in tags])
    return Response(status_code=204)


@router.get("/templates/aliases/{alias}")
async def alias(alias: str, svc: DaemonDep, who: Caller) -> Json:
    return {"templateID": svc.template_builds.named(who.tenant, alias).id, "public": False}


@router.get("/templates/{template_id}/tags")
async def list_tags(template_id: str, svc: DaemonDep, who: Caller) -> list[Json]:
    return [
        {"tag": tag, "buildID": build, "createdAt": iso(datetime.fromisoformat(at))}
        for tag, build, at in svc.template_builds.tags(who.tenant, template_id)
    ]


@router.get("/v2/templates")
@router.get("/templates")
async def list_templates(svc: DaemonDep, who: Caller) -> JSONResponse:
    listed = [shown(svc, named, builds) for named, builds in svc.template_builds.listed(who.tenant)]
    return JSONResponse([t for t in listed if t is not None])


@router.get("/templates/{template_id}")
async def get_template(template_id: str, svc: DaemonDep, who: Caller) -> Json:
    named = svc.template_builds.named(who.tenant, template_id)
    builds = svc.template_builds.builds(named)
    out = shown(svc, named, builds) or _summary(svc, named, builds, None)
    out["builds"] = [_build(svc, b) for b in builds]
    return out


def shown(
    svc: Daemon, named: NamedTemplateRecord, builds: list[TemplateBuildRecord]
) -> Json | None:
    ready = [b for b in builds if b.state == "ready"]
    return _summary(svc, named, builds, ready[-1]) if ready else None


def _summary(
    svc: Daemon,
    named: NamedTemplateRecord,
    builds: list[TemplateBuildRecord],
    build: TemplateBuildRecord | None,
) -> Json:
    last = build or (builds[-1] if builds else None)
    detail = _build(svc, last) if last else {}
    return {
        "templateID": named.id,
        "buildID": last.id if last else "",
        "cpuCount": detail.get("cpuCount", 1),
        "memoryMB": detail.get("memoryMB", 512),
        "diskSizeMB": detail.get("diskSizeMB", 0),
        "public": False,
        "aliases": [named.name],
        "names": [named.name],
        "createdAt": _at(named.created_at),
        "updatedAt": _at(named.updated_at),
        "createdBy": None,
        "lastSpawnedAt": None,
        "spawnCount": 0,
        "buildCount": len(builds),
        "envdVersion": ENVD_VERSION,
        "buildStatus": STATES.get(last.state, "error") if last else "waiting",
    }


def _build(svc: Daemon, row: TemplateBuildRecord) -> Json:
    shape: dict[str, Any] = json.loads(row.spec)
    disk = 0
    if row.image:
        try:
            disk = svc.templates.disk_mib(row.image)
        except errors.CellaError:
            disk = 0
    out: Json = {
        "buildID": row.id,
        "status": STATES.get(row.state, "error"),
        "createdAt": _at(row.created_at),
        "updatedAt": _at(row.updated_at),
        "cpuCount": shape.get("vcpus") or 1,
        "memoryMB": shape.get("memory_mib") or 512,
        "diskSizeMB": disk,
        "envdVersion": ENVD_VERSION,
    }
    if row.state in ("ready", "error"):
        out["finishedAt"] = out["updatedAt"]
    return out


def _at(stamp: str) -> str:
    return iso(datetime.fromisoformat(stamp).astimezone(UTC))
