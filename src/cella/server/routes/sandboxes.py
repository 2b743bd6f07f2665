"""Sandbox lifecycle, exec and events."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import StreamingResponse

from cella import errors
from cella.guest.client import Output, Started
from cella.models import (
    Event,
    EventList,
    ExecEvent,
    ExecPolicy,
    ExecRequest,
    ExecResult,
    LineageNode,
    MetricList,
    MetricSample,
    MountRefreshList,
    ProcessInfo,
    ProcessList,
    Sandbox,
    SandboxAccess,
    SandboxAccessView,
    SandboxCreate,
    SandboxList,
    SandboxState,
    SandboxUsage,
    StopRequest,
    encode_data,
    parse_pairs,
)
from cella.server.deps import Auth, DaemonDep, IdempotencyKey, fleet_grant, jsonl
from cella.service.daemon import Daemon
from cella.service.keys import Principal, require_admin
from cella.store import SandboxRecord

router = APIRouter(prefix="/v1/sandboxes", tags=["sandboxes"])
ID = Annotated[str, "sandbox id"]


def shown(svc: Daemon, who: Principal, row: SandboxRecord) -> Sandbox:
    """The sandbox with what the caller may do with it (an admin listing every tenant's
    acts for each as its owner)."""
    level = svc.registry.permission(who, row) or svc.registry.permission(
        Principal.service(row.tenant) if who.admin else who, row
    )
    return Sandbox.model_validate(row).model_copy(
        update={"permission": level.name if level else None}
    )


@router.post("", status_code=201, response_model=Sandbox)
async def create_sandbox(
    body: SandboxCreate,
    request: Request,
    svc: DaemonDep,
    who: Auth,
    idempotency_key: IdempotencyKey = None,
) -> Sandbox:
    """Boots a new sandbox from a template and returns it running (once per
    `Idempotency-Key`: a retry gets the same sandbox)."""

    svc.replicas.refuse_here(body)  # a fleet's gateway keeps replicas, not a daemon

    async def make() -> list[str]:
        return [(await svc.create(who, body, fleet_grant=fleet_grant(request))).id]

    ids = await svc.idempotency.once(who.tenant, "sandboxes.create", idempotency_key, body, make)
    return shown(svc, who, svc.registry.get(who, ids[0]))


@router.get("", response_model=SandboxList)
async def list_sandboxes(
    svc: DaemonDep,
    who: Auth,
    state: SandboxState | None = None,
    label: Annotated[list[str] | None, Query(description="key=value, repeatable")] = None,
    all_tenants: Annotated[bool, Query(description="every tenant's (admin keys)")] = False,
) -> SandboxList:
    """The sandboxes the key may see (`all_tenants`: every tenant's, for admin keys)."""
    labels = parse_pairs(label, "label filter")
    if all_tenants:
        require_admin(who, "list every tenant's sandboxes")
    rows = svc.registry.find(None if all_tenants else who, state.value if state else None, labels)
    return SandboxList(sandboxes=[shown(svc, who, r) for r in rows])


@router.get("/{sandbox_id}", response_model=Sandbox)
async def get_sandbox(sandbox_id: ID, svc: DaemonDep, who: Auth) -> Sandbox:
    return shown(svc, who, svc.registry.get(who, sandbox_id))


@router.get("/{sandbox_id}/access", response_model=SandboxAccessView)
async def get_access(sandbox_id: ID, svc: DaemonDep, who: Auth) -> SandboxAccessView:
    """Who made the sandbox, who may use it, and what this key may do with it."""
    return svc.sharing.get(who, sandbox_id)


@router.put("/{sandbox_id}/access", response_model=SandboxAccessView)
async def set_access(
    sandbox_id: ID, body: SandboxAccess, svc: DaemonDep, who: Auth
) -> SandboxAccessView:
    """Sets who may use the sandbox (its visibility and shares; a key that manages it)."""
    return await svc.sharing.set(who, sandbox_id, body)


@router.get("/{sandbox_id}/exec-policy", response_model=ExecPolicy)
async def get_exec_policy(sandbox_id: ID, svc: DaemonDep, who: Auth) -> ExecPolicy:
    """Which executables the sandbox's guest lets run (none set: every one)."""
    return svc.exec_policies.get(who, sandbox_id)


@router.put("/{sandbox_id}/exec-policy", response_model=ExecPolicy)
async def set_exec_policy(
    sandbox_id: ID, body: ExecPolicy, svc: DaemonDep, who: Auth
) -> ExecPolicy:
    """Replaces the exec policy (a key that manages the sandbox); a running guest holds
    it from the next execve on. `{"default": "allow", "rules": []}` lifts it."""
    return await svc.exec_policies.set(who, sandbox_id, body)


@router.post("/{sandbox_id}/stop", response_model=Sandbox)
async def stop_sandbox(
    sandbox_id: ID, svc: DaemonDep, who: Auth, body: StopRequest | None = None
) -> Sandbox:
    """Ends every process in the sandbox; its file system is kept. With `memory: true` (or
    the sandbox's `stop_keeps_memory`) it is paused instead: processes and memory kept."""
    memory = body.memory if body is not None else None
    return Sandbox.model_validate(await svc.lifecycle.stop(who, sandbox_id, memory=memory))


@router.post("/{sandbox_id}/pause", response_model=Sandbox)
async def pause_sandbox(sandbox_id: ID, svc: DaemonDep, who: Auth) -> Sandbox:
    """Freezes the sandbox: no CPU, memory and processes kept for `resume`."""
    return Sandbox.model_validate(await svc.lifecycle.pause(who, sandbox_id))


@router.post("/{sandbox_id}/resume", response_model=Sandbox)
async def resume_sandbox(sandbox_id: ID, svc: DaemonDep, who: Auth) -> Sandbox:
    """Paused: runs on with its processes. Stopped: boots again on the same disk."""
    return Sandbox.model_validate(await svc.lifecycle.resume(who, sandbox_id))


@router.delete("/{sandbox_id}", status_code=204)
async def delete_sandbox(sandbox_id: ID, svc: DaemonDep, who: Auth) -> Response:
    """Destroys the sandbox and frees its disk."""
    await svc.lifecycle.delete(who, sandbox_id)
    return Response(status_code=204)


@router.get("/{sandbox_id}/usage", response_model=SandboxUsage)
async def sandbox_usage(sandbox_id: ID, svc: DaemonDep, who: Auth) -> SandboxUsage:
    """Limits, and live usage: CPU time, memory (host and guest), disk, processes."""
    return SandboxUsage.model_validate(await svc.usage.usage(who, sandbox_id))


@router.get("/{sandbox_id}/metrics", response_model=MetricList)
async def sandbox_metrics(
    sandbox_id: ID,
    svc: DaemonDep,
    who: Auth,
    start: Annotated[float | None, Query(ge=0, description="unix seconds")] = None,
    end: Annotated[float | None, Query(ge=0, description="unix seconds")] = None,
) -> MetricList:
    """CPU, memory and disk over time, sampled while the sandbox runs (oldest first)."""
    rows = svc.metrics.history(who, sandbox_id, start, end)
    return MetricList(metrics=[MetricSample.model_validate(r, from_attributes=True) for r in rows])


@router.get(
    "/{sandbox_id}/screenshot",
    response_class=Response,
    responses={200: {"content": {"image/png": {}}, "description": "a PNG of the screen"}},
)
async def screenshot(sandbox_id: ID, svc: DaemonDep, who: Auth) -> Response:
    """A PNG of a desktop sandbox's screen (409 for a sandbox without a desktop)."""
    png = await svc.desktop.screenshot(who, sandbox_id)
    # the guest's bytes: checked to be a PNG, and never sniffed into anything else
    headers = {"X-Content-Type-Options": "nosniff", "Content-Security-Policy": "sandbox"}
    return Response(png, media_type="image/png", headers=headers)


@router.post("/{sandbox_id}/mounts/refresh", response_model=MountRefreshList)
async def refresh_mounts(
    sandbox_id: ID,
    svc: DaemonDep,
    who: Auth,
    mount: Annotated[str | None, Query(description="only this mount (its id)")] = None,
) -> MountRefreshList:
    """Fetches the sandbox's git mounts (or one) now and resets each to its ref."""
    return MountRefreshList(mounts=await svc.mounts.refresh(who, sandbox_id, mount))


After = Annotated[int, Query(ge=0, le=2**63 - 1, description="only events after this id")]
Types = Annotated[list[str] | None, Query(alias="type", description="only these types")]
ExecId = Annotated[
    int | None,
    Query(
        alias="exec",
        ge=1,
        le=2**63 - 1,
        description="only this exec's event (its id) and those under it: its processes",
    ),
]


@router.get("/{sandbox_id}/events", response_model=EventList)
async def sandbox_events(
    sandbox_id: ID,
    svc: DaemonDep,
    who: Auth,
    after: After = 0,
    types: Types = None,
    limit: Annotated[int, Query(ge=1, le=10000)] = 1000,
    exec_id: ExecId = None,
) -> EventList:
    """The sandbox's trace: lifecycle, execs (and the processes each started: `process`
    events whose `parent` names the exec's event and the parent process), file changes,
    egress decisions (with the guest process that connected), limit hits, in order (kept
    after the sandbox is deleted). Secrets appear as `[secret:NAME]`."""
    rows = svc.trace.events(who, sandbox_id, after, types, limit, exec_id)
    return EventList(events=[Event.model_validate(r) for r in rows])


@router.get(
    "/{sandbox_id}/events/stream",
    response_class=StreamingResponse,
    responses={
        200: {
            "content": {"application/x-ndjson": {"schema": Event.model_json_schema()}},
            "description": "JSON Lines of Event",
        }
    },
)
async def stream_events(
    sandbox_id: ID,
    svc: DaemonDep,
    who: Auth,
    after: After = 0,
    types: Types = None,
    follow: Annotated[bool, Query(description="keep streaming until the sandbox is gone")] = False,
    exec_id: ExecId = None,
) -> StreamingResponse:
    """The trace as JSON Lines (an export); with `follow`, new events as they happen."""
    svc.registry.owned(who, sandbox_id)  # unknown ids fail before streaming

    async def lines() -> AsyncIterator[bytes]:
        async for row in svc.trace.stream(who, sandbox_id, after, types, follow, exec_id):
            yield jsonl(Event.model_validate(row).model_dump(mode="json"))

    return StreamingResponse(lines(), media_type="application/x-ndjson")


@router.get("/{sandbox_id}/processes", response_model=ProcessList)
async def list_processes(sandbox_id: ID, svc: DaemonDep, who: Auth) -> ProcessList:
    """Commands that outlive their connection, e.g. the image's `entrypoint`."""
    return ProcessList(processes=[p.summary() for p in svc.processes.list(who, sandbox_id)])


@router.get("/{sandbox_id}/processes/{process_id}", response_model=ProcessInfo)
async def get_process(sandbox_id: ID, process_id: str, svc: DaemonDep, who: Auth) -> ProcessInfo:
    return svc.processes.get(who, sandbox_id, process_id).info()


@router.get("/{sandbox_id}/lineage", response_model=LineageNode)
async def sandbox_lineage(sandbox_id: ID, svc: DaemonDep, who: Auth) -> LineageNode:
    """The family the sandbox belongs to, from its first ancestor: snapshots and forks."""
    return LineageNode.model_validate(svc.trace.lineage(who, sandbox_id))


@router.post("/{sandbox_id}/exec", response_model=ExecResult)
async def exec_command(sandbox_id: ID, body: ExecRequest, svc: DaemonDep, who: Auth) -> ExecResult:
    """Runs a command to completion and returns its exit status and output."""
    return await svc.exec.run(who, sandbox_id, body, caller=True)


@router.post(
    "/{sandbox_id}/exec/stream",
    response_class=StreamingResponse,
    responses={
        200: {
            "content": {"application/x-ndjson": {"schema": ExecEvent.model_json_schema()}},
            "description": "JSON Lines of ExecEvent, as produced",
        }
    },
)
async def exec_stream(
    sandbox_id: ID, body: ExecRequest, svc: DaemonDep, who: Auth
) -> StreamingResponse:
    """Runs a command and streams started/stdout/stderr/exit events as JSON Lines."""
    svc.exec.check(who, sandbox_id)  # unknown or stopped sandboxes fail before streaming
    start = time.monotonic()

    async def lines() -> AsyncIterator[bytes]:
        try:
            async for event in svc.exec.stream(who, sandbox_id, body, caller=True):
                if isinstance(event, Started):
                    yield jsonl({"type": "started", "pid": event.pid})
                elif isinstance(event, Output):
                    data, enc = encode_data(event.data)
                    yield jsonl({"type": event.stream, "data": data, "encoding": enc})
                else:
                    yield jsonl(
                        {
                            "type": "exit",
                            "exit_code": event.exit_code,
                            "signal": event.signal,
                            "timed_out": event.timed_out,
                            "duration_ms": round((time.monotonic() - start) * 1000, 2),
                        }
                    )
        except errors.CellaError as exc:
            yield jsonl({"type": "error", "code": exc.code, "message": exc.message})

    return StreamingResponse(lines(), media_type="application/x-ndjson")
