"""The LangSmith control plane (`/api/v2/sandboxes`, also served at `/v2/sandboxes` as the
SDK's README writes it): boxes addressed by name, their status, start and stop, retention,
service URLs, and snapshots with names and moving tags. Every call goes to cella's service
rooms; nothing here runs a sandbox itself."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Annotated, Any

from fastapi import APIRouter, Body, Query, Request, Response

from cella import errors
from cella.models import SandboxCreate, SandboxUpdate
from cella.server.compat.langsmith.create import (
    CELLA_NAMES,
    flag,
    read_create,
    seconds,
    validated,
)
from cella.server.compat.langsmith.proxy_config import network_of
from cella.server.compat.langsmith.shapes import (
    exec_defaults,
    iso,
    not_supported,
    sandbox_json,
    snapshot_json,
)
from cella.server.deps import Caller, DaemonDep
from cella.service.daemon import Daemon
from cella.service.lifecycle import UNSET
from cella.store import SandboxRecord, SnapshotRecord

Json = dict[str, Any]
JsonBody = Annotated[dict[str, Any], Body()]


def router(prefix: str) -> APIRouter:
    api = APIRouter(prefix=prefix, include_in_schema=False)

    def box(svc: Daemon, tenant: str, name: str) -> SandboxRecord:
        try:
            return svc.registry.named(tenant, name)
        except errors.NotFound:
            raise errors.NotFound(f"Sandbox '{name}' not found") from None

    def shown(svc: Daemon, request: Request, row: SandboxRecord) -> Json:
        return sandbox_json(row, str(request.base_url), fs_mib(svc, row.template))

    # -- boxes --------------------------------------------------------------------------

    @api.post("/boxes")
    async def create_box(request: Request, svc: DaemonDep, who: Caller, body: JsonBody) -> Json:
        spec = create_spec(svc, who.tenant, body)
        made = svc.create(who.tenant, spec, creator=who)
        task = svc.background.start(made, name=f"create-{spec.name}")
        if body.get("wait_for_ready", True):
            timeout = float(body.get("timeout") or 30)
            try:
                row = await asyncio.wait_for(asyncio.shield(task), timeout)
            except TimeoutError:  # it carries on; the caller can wait for it
                raise errors.Timeout(f"sandbox {spec.name} not ready after {timeout:g}s") from None
            return shown(svc, request, row)
        for _ in range(200):  # answer as soon as the sandbox exists (provisioning)
            if task.done():
                return shown(svc, request, task.result())
            with contextlib.suppress(errors.NotFound):
                return shown(svc, request, svc.registry.named(who.tenant, spec.name or ""))
            await asyncio.sleep(0.01)
        return shown(svc, request, await task)

    @api.get("/boxes")
    async def list_boxes(request: Request, svc: DaemonDep, who: Caller) -> Json:
        rows = svc.registry.find(who.tenant)
        return {"sandboxes": [shown(svc, request, r) for r in rows if r.state != "deleting"]}

    @api.get("/boxes/{name}")
    async def get_box(name: str, request: Request, svc: DaemonDep, who: Caller) -> Json:
        return shown(svc, request, box(svc, who.tenant, name))

    @api.patch("/boxes/{name}")
    async def update_box(
        name: str, request: Request, svc: DaemonDep, who: Caller, body: JsonBody
    ) -> Json:
        row = box(svc, who.tenant, name)
        unknown = set(body) - {"name", "idle_ttl_seconds", "delete_after_stop_seconds",
                               "proxy_config", "run_config"}  # fmt: skip
        if unknown:
            raise not_supported(f"updating {sorted(unknown)}")
        change = update_of(body, row)  # all of it checked before anything changes
        if "proxy_config" in body:
            policy = network_of(body["proxy_config"], svc, who.tenant)
            await svc.egress.set_network(who.tenant, row.id, policy)
        row = await svc.lifecycle.update(
            who.tenant,
            row.id,
            name=change.name,
            idle_timeout_seconds=given(change, "idle_timeout_seconds"),
            delete_after_stop_seconds=given(change, "delete_after_stop_seconds"),
            exec_defaults=change.exec_defaults,
        )
        return shown(svc, request, row)

    @api.delete("/boxes/{name}", status_code=204)
    async def delete_box(name: str, svc: DaemonDep, who: Caller) -> Response:
        await svc.lifecycle.delete(who.tenant, box(svc, who.tenant, name).id)
        return Response(status_code=204)

    @api.get("/boxes/{name}/status")
    async def box_status(name: str, request: Request, svc: DaemonDep, who: Caller) -> Json:
        view = shown(svc, request, box(svc, who.tenant, name))
        return {"status": view["status"], "status_message": view["status_message"]}

    @api.post("/boxes/{name}/start")
    async def start_box(name: str, svc: DaemonDep, who: Caller) -> Json:
        row = box(svc, who.tenant, name)
        # booting takes seconds: the SDK polls /status for it
        svc.background.start(svc.lifecycle.resume(who.tenant, row.id), name=f"start-{row.id}")
        return {"status": "provisioning"}

    @api.post("/boxes/{name}/stop")
    async def stop_box(name: str, svc: DaemonDep, who: Caller) -> Json:
        row = box(svc, who.tenant, name)
        # preserve_memory_on_stop (the row's stop_keeps_memory) makes this stop a pause
        svc.background.start(svc.lifecycle.stop(who.tenant, row.id), name=f"stop-{row.id}")
        return {"status": "stopped"}

    @api.post("/boxes/{name}/service-url")
    async def service_url(
        name: str, request: Request, svc: DaemonDep, who: Caller, body: JsonBody
    ) -> Json:
        row = box(svc, who.tenant, name)
        if body.get("access"):
            raise not_supported(f"login-mode service URLs (access={body['access']!r})")
        token = svc.ports.mint(
            who.tenant,
            row.id,
            int(body.get("port") or 0),
            int(body.get("expires_in_seconds") or 600),
        )
        url = str(request.base_url).rstrip("/") + f"/v1/services/{row.id}/{token.port}"
        return {
            "service_url": url,
            "browser_url": f"{url}/?cella_token={token.token}",
            "token": token.token,
            "expires_at": iso(token.expires_at),
            "embed_url": "",
            "embed_origins": [],
        }

    @api.post("/boxes/{name}/download-url")
    async def download_url(name: str, svc: DaemonDep, who: Caller) -> Json:
        box(svc, who.tenant, name)
        raise not_supported("pre-signed download URLs; read the file through the data plane")

    # -- snapshots ------------------------------------------------------------------------

    @api.post("/boxes/{name}/snapshot")
    async def capture(name: str, svc: DaemonDep, who: Caller, body: JsonBody) -> Json:
        row = box(svc, who.tenant, name)
        if body.get("docker_image"):
            raise not_supported("exporting a Docker image from inside a sandbox")
        if body.get("checkpoint"):
            raise not_supported(
                f"promoting a checkpoint ({body['checkpoint']!r}); omit it to capture the "
                "running sandbox"
            )
        if not body.get("name"):
            raise errors.InvalidArgument("a snapshot needs a name")
        snap = await svc.snapshots.snapshot(
            who.tenant,
            row.id,
            str(body["name"]),
            str(body.get("tag") or "latest"),
            memory=flag(body, "include_memory") or False,  # LangSmith's default: the disk
        )
        return snapshot_view(svc, who.tenant, snap)

    @api.post("/snapshots")
    async def create_snapshot(svc: DaemonDep, who: Caller, body: JsonBody) -> Json:
        raise not_supported(
            f"building a snapshot from the image {body.get('docker_image')!r}: an operator "
            "makes a template of it (`cella template build NAME --from-image REF`); capture "
            "a running sandbox instead"
        )

    @api.get("/snapshots")
    async def list_snapshots(
        svc: DaemonDep,
        who: Caller,
        name_contains: str | None = None,
        limit: int = Query(default=50, ge=1, le=500),
        offset: int = Query(default=0, ge=0),
    ) -> Json:
        rows = [s for s in svc.snapshots.find(who.tenant) if s.state != "deleted"]
        if name_contains:
            rows = [s for s in rows if name_contains.lower() in s.name.lower()]
        page = rows[offset : offset + limit]
        return {
            "snapshots": [snapshot_view(svc, who.tenant, s) for s in page],
            "offset": offset,
        }

    @api.get("/snapshots/{ref:path}")
    async def get_snapshot(ref: str, svc: DaemonDep, who: Caller) -> Json:
        try:
            snap = svc.snapshots.resolve(who.tenant, ref)
        except errors.NotFound:
            raise errors.NotFound(f"Snapshot '{ref}' not found") from None
        return snapshot_view(svc, who.tenant, snap)

    @api.get("/snapshots-by-name/{name:path}")
    async def snapshot_tags(name: str, svc: DaemonDep, who: Caller) -> Json:
        if ":" in name:
            raise errors.InvalidArgument("a snapshot name has no tag (drop ':tag')")
        tags = svc.snapshots.tags(who.tenant, name)
        return {"name": name, "tags": [{"tag": t, "snapshot_id": sid} for t, sid in tags]}

    @api.delete("/snapshots/{ref:path}", status_code=204)
    async def delete_snapshot(ref: str, svc: DaemonDep, who: Caller) -> Response:
        snap = svc.snapshots.resolve(who.tenant, ref)
        await svc.snapshots.delete(who.tenant, snap.id)
        return Response(status_code=204)

    return api


def create_spec(svc: Daemon, tenant: str, body: Json) -> SandboxCreate:
    """A LangSmith box create as a cella sandbox create, with what this daemon adds: the
    egress rules (their secrets kept), the snapshot's id, a disk larger than the template's."""
    box = read_create(body)
    network = None if box.proxy_config is None else network_of(box.proxy_config, svc, tenant)
    snapshot_id = None
    if box.snapshot:
        snap = svc.snapshots.resolve(tenant, box.snapshot)
        box.check_snapshot_shape(snap.vcpus, snap.memory_mib)
        snapshot_id = snap.id
    disk_mib = box.fs_capacity_mib
    if disk_mib is not None and disk_mib <= fs_mib(svc, "default"):
        disk_mib = None  # the template's disk is large enough
    return box.spec(snapshot_id=snapshot_id, network=network, disk_mib=disk_mib)


def update_of(body: Json, row: SandboxRecord) -> SandboxUpdate:
    """A LangSmith box update as a cella update, held to the bounds of a create."""
    fields: Json = {}
    if body.get("name") is not None:
        fields["name"] = body["name"]
    for field in ("idle_ttl_seconds", "delete_after_stop_seconds"):
        if field in body:
            fields[CELLA_NAMES.get(field, field)] = seconds(body, field)
    if "run_config" in body:
        fields["exec_defaults"] = exec_defaults(body["run_config"], row.exec_defaults)
    return validated(SandboxUpdate, fields)


def given(change: SandboxUpdate, field: str) -> Any:
    """The update's value of `field`, or UNSET when it was left out."""
    return getattr(change, field) if field in change.model_fields_set else UNSET


def snapshot_view(svc: Daemon, tenant: str, snap: SnapshotRecord) -> Json:
    return snapshot_json(
        snap,
        svc.snapshots.tags_of(tenant, snap.id),
        fs_mib(svc, snap.template),
        svc.snapshots.memory_bytes(snap.id) if snap.memory else None,
    )


def fs_mib(svc: Daemon, template: str) -> int:
    with contextlib.suppress(errors.CellaError):
        return svc.templates.disk_mib(template)
    return 0
