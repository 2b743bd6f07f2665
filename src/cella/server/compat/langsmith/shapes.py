"""The LangSmith Sandboxes API's shapes: who is calling (`X-Api-Key`), how cella's records
and errors look to its SDK (`langsmith==0.14.17`, whose source is the specification)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from fastapi import Request, Response
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from cella import errors
from cella.models import ExecDefaults, SandboxState
from cella.server.error_shapes import ErrorShape, describe
from cella.store import SandboxRecord, SnapshotRecord

PREFIXES = ("/api/v2/sandboxes", "/v2/sandboxes")
DATAPLANE = "/api/v2/sandboxes/dataplane"
S = SandboxState
STATUS = {
    S.creating: "provisioning",
    S.starting: "provisioning",
    S.running: "ready",
    S.paused: "stopped",  # a stop that kept memory (`preserve_memory_on_stop`)
    S.stopping: "stopped",
    S.stopped: "stopped",
    S.error: "failed",
}
SNAPSHOT_STATUS = {"creating": "building", "ready": "ready", "error": "failed"}
DEFAULT_IDLE_TTL = 600  # the SDK's documented default when a create does not say


def iso(stamp: str | float | None) -> str | None:
    if stamp is None or stamp == "":
        return None
    if isinstance(stamp, int | float):
        stamp = datetime.fromtimestamp(stamp, UTC).isoformat()
    return stamp.replace("+00:00", "Z")


def run_config(defaults: ExecDefaults) -> dict[str, Any]:
    return {"user": defaults.user, "work_dir": defaults.cwd, "env_vars": defaults.env}


def exec_defaults(config: dict[str, Any] | None, base: ExecDefaults | None = None) -> ExecDefaults:
    """`run_config` (user, work_dir, env_vars) over `base`: user and work_dir replace,
    env_vars merge."""
    base = base or ExecDefaults()
    if not config:
        return base
    if not isinstance(config, dict):
        raise errors.InvalidArgument("run_config must be an object")
    unknown = set(config) - {"user", "work_dir", "env_vars"}
    if unknown:
        raise errors.InvalidArgument(f"run_config: unknown fields {sorted(unknown)}")
    env = config.get("env_vars") or {}
    if not isinstance(env, dict):
        raise errors.InvalidArgument("run_config.env_vars must be an object")
    try:
        return ExecDefaults(
            user=config.get("user") or base.user,
            cwd=config.get("work_dir") or base.cwd,
            env={**base.env, **env},
        )
    except ValidationError as exc:
        raise errors.InvalidArgument(f"run_config: {describe(exc.errors())}") from None


def sandbox_json(row: SandboxRecord, base_url: str, fs_mib: int) -> dict[str, Any]:
    return {
        "id": row.id,
        "name": row.name or row.id,
        "status": STATUS.get(row.state, "failed"),
        "status_message": row.error,
        "dataplane_url": f"{base_url.rstrip('/')}{DATAPLANE}/{row.id}",
        "created_at": iso(row.created_at),
        "updated_at": iso(row.updated_at),
        "idle_ttl_seconds": row.idle_timeout_seconds or 0,
        "delete_after_stop_seconds": row.delete_after_stop_seconds or 0,
        "stopped_at": iso(row.stopped_at),
        "snapshot_id": row.snapshot_id,
        "vcpus": row.vcpus,
        "mem_bytes": row.memory_mib << 20,
        "fs_capacity_bytes": (row.disk_mib or fs_mib) << 20,
        "run_config": run_config(row.exec_defaults),
        "persistent": True,
        "labels": dict(row.labels),
        "preserve_memory_on_stop": row.stop_keeps_memory,
        "access_delegation": delegation_json(row),
    }


def delegation_json(row: SandboxRecord) -> dict[str, Any] | None:
    """The grant as it was asked for, in LangSmith's words (no key, no creator)."""
    grant = row.access_delegation
    if grant is None:
        return None
    shown: dict[str, Any] = {"mode": grant["mode"].upper()}
    if grant["permissions"]:
        shown["permissions"] = grant["permissions"]
    return shown


def snapshot_json(
    row: SnapshotRecord, tags: list[str], fs_mib: int, memory_bytes: int | None = None
) -> dict[str, Any]:
    """`memory_snapshot_size_bytes` is set iff the snapshot holds memory (the SDK's sign
    that a sandbox made from it resumes instead of booting)."""
    return {
        "id": row.id,
        "name": row.name,
        "status": SNAPSHOT_STATUS.get(row.state, "failed"),
        "status_message": row.error,
        "source_sandbox_id": row.sandbox_id,
        "fs_capacity_bytes": fs_mib << 20,
        "fs_used_bytes": row.size_bytes,
        "memory_snapshot_size_bytes": (memory_bytes or 0) if row.memory else None,
        "tags": tags,
        "created_at": iso(row.created_at),
        "updated_at": iso(row.updated_at),
    }


# -- errors as the SDK reads them ---------------------------------------------------------

# cella's codes as LangSmith's (status, detail.error); the SDK maps those to its exceptions
ERRORS: dict[str, tuple[int, str]] = {
    "not_found": (404, "NotFound"),
    "unauthenticated": (401, "Unauthorized"),
    "permission_denied": (403, "Forbidden"),
    "already_exists": (409, "Conflict"),
    "in_use": (409, "Conflict"),
    "invalid_state": (409, "InvalidState"),
    "quota_exceeded": (429, "QuotaExceeded"),
    "capacity_exceeded": (503, "Unschedulable"),
    "payload_too_large": (413, "PayloadTooLarge"),
    "timeout": (408, "Timeout"),
    "no_space": (507, "InsufficientStorage"),
    "snapshot_corrupt": (409, "SnapshotCorrupt"),
    # a mount that failed to clone: the SDK's creation failure (ResourceCreationError)
    "mount_failed": (422, "SandboxConfig"),
}


def error_response(exc: errors.CellaError, dataplane: bool) -> tuple[int, dict[str, Any]]:
    """The status and body the LangSmith SDK turns into the matching exception."""
    # pydantic's shape: the SDK's ValidationError (a failed mount is a creation failure)
    if isinstance(exc, errors.InvalidArgument) and exc.code not in ERRORS:
        detail = [{"loc": ["body"], "msg": exc.message, "type": "value_error"}]
        return 422, {"detail": detail}
    if isinstance(exc, errors.InvalidState) and dataplane:
        return 400, {"detail": {"error": "NotReady", "message": exc.message}}
    if dataplane and exc.code in ("not_found", "is_a_directory", "not_a_directory"):
        return 404, {"detail": {"error": "FileNotFound", "message": exc.message}}
    status, kind = ERRORS.get(exc.code, (500 if exc.status >= 500 else exc.status, exc.code))
    return status, {"detail": {"error": kind, "message": exc.message}}


def render_error(request: Request, exc: errors.CellaError) -> Response:
    status, body = error_response(exc, "/dataplane/" in request.url.path)
    headers = {"retry-after": "0"} if status == 429 else None
    return JSONResponse(body, status_code=status, headers=headers)


ERROR_SHAPE = ErrorShape(lambda request: request.url.path.startswith(PREFIXES), render_error)


def not_supported(what: str) -> errors.CellaError:
    """What cella cannot do, said plainly (a 400 the SDK raises as SandboxClientError)."""
    exc = errors.RequestError(f"not supported by cella: {what}")
    return exc
