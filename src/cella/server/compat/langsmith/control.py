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
from cella.models import BucketAuth, BucketMount, SandboxCreate, SandboxUpdate
from cella.policy.access import Permission
from cella.server.compat.langsmith.create import (
    CELLA_NAMES,
    flag,
    read_create,
    seconds,
    validated,
)
from cella.server.compat.langsmith.files import absolute
from cella.server.compat.langsmith.proxy_config import Opaque, network_of, secret_of
from cella.server.compat.langsmith.shapes import (
    exec_defaults,
    iso,
    not_supported,
    sandbox_json,
    snapshot_json,
)
from cella.server.deps import Caller, DaemonDep, IdempotencyKey, fleet_grant
from cella.server.routes.downloads import link_url
from cella.server.routes.ports import login_url
from cella.service.daemon import Daemon
from cella.service.keys import Principal
from cella.service.lifecycle import UNSET
from cella.service.logins import ACCESS as LOGIN_ACCESS
from cella.store import SandboxRecord, SnapshotRecord

Json = dict[str, Any]
VIEW, MANAGE = Permission.view, Permission.manage
JsonBody = Annotated[dict[str, Any], Body()]


def router(prefix: str) -> APIRouter:
    api = APIRouter(prefix=prefix, include_in_schema=False)

    def box(svc: Daemon, who: Principal, name: str, need: Permission = VIEW) -> SandboxRecord:
        """The caller's box `name`, if it may `need` it (checked before anything starts
        in the background, where a refusal would be lost)."""
        try:
            return svc.registry.named(who, name, need)
        except errors.NotFound:
            raise errors.NotFound(f"Sandbox '{name}' not found") from None

    def shown(svc: Daemon, request: Request, row: SandboxRecord) -> Json:
        size = fs_mib(svc, row.template, row.base_snapshot_id)
        return sandbox_json(row, str(request.base_url), size)

    # -- boxes --------------------------------------------------------------------------

    @api.post("/boxes")
    async def create_box(
        request: Request,
        svc: DaemonDep,
        who: Caller,
        body: JsonBody,
        idempotency_key: IdempotencyKey = None,
    ) -> Json:
        """A retry without a key is refused by the name (409: unique per tenant), never
        made twice; with an `Idempotency-Key` it gets the first one's sandbox."""
        spec = create_spec(svc, who.tenant, body)

        async def make() -> list[str]:
            return [(await svc.create(who, spec, fleet_grant=fleet_grant(request))).id]

        async def made() -> SandboxRecord:
            key = idempotency_key
            ids = await svc.idempotency.once(who.tenant, "langsmith.create", key, body, make)
            return svc.registry.get(who, ids[0])

        task = svc.background.start(made(), name=f"create-{spec.name}")
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
                return shown(svc, request, svc.registry.named(who, spec.name or ""))
            await asyncio.sleep(0.01)
        return shown(svc, request, await task)

    @api.get("/boxes")
    async def list_boxes(request: Request, svc: DaemonDep, who: Caller) -> Json:
        rows = svc.registry.find(who)
        return {"sandboxes": [shown(svc, request, r) for r in rows if r.state != "deleting"]}

    @api.get("/boxes/{name}")
    async def get_box(name: str, request: Request, svc: DaemonDep, who: Caller) -> Json:
        return shown(svc, request, box(svc, who, name))

    @api.patch("/boxes/{name}")
    async def update_box(
        name: str, request: Request, svc: DaemonDep, who: Caller, body: JsonBody
    ) -> Json:
        row = box(svc, who, name, MANAGE)
        unknown = set(body) - {"name", "idle_ttl_seconds", "delete_after_stop_seconds",
                               "proxy_config", "run_config"}  # fmt: skip
        if unknown:
            raise not_supported(f"updating {sorted(unknown)}")
        change = update_of(body, row)  # all of it checked before anything changes
        if "proxy_config" in body:
            policy = network_of(body["proxy_config"], svc, who.tenant)
            await svc.egress.set_network(who, row.id, policy)
        row = await svc.lifecycle.update(
            who,
            row.id,
            name=change.name,
            idle_timeout_seconds=given(change, "idle_timeout_seconds"),
            delete_after_stop_seconds=given(change, "delete_after_stop_seconds"),
            exec_defaults=change.exec_defaults,
        )
        return shown(svc, request, row)

    @api.delete("/boxes/{name}", status_code=204)
    async def delete_box(name: str, svc: DaemonDep, who: Caller) -> Response:
        await svc.lifecycle.delete(who, box(svc, who, name, MANAGE).id)
        return Response(status_code=204)

    @api.get("/boxes/{name}/status")
    async def box_status(name: str, request: Request, svc: DaemonDep, who: Caller) -> Json:
        view = shown(svc, request, box(svc, who, name))
        return {"status": view["status"], "status_message": view["status_message"]}

    @api.post("/boxes/{name}/start")
    async def start_box(name: str, svc: DaemonDep, who: Caller) -> Json:
        row = box(svc, who, name, Permission.exec)
        # booting takes seconds: the SDK polls /status for it
        svc.background.start(svc.lifecycle.resume(who, row.id), name=f"start-{row.id}")
        return {"status": "provisioning"}

    @api.post("/boxes/{name}/stop")
    async def stop_box(name: str, svc: DaemonDep, who: Caller) -> Json:
        row = box(svc, who, name, MANAGE)
        # preserve_memory_on_stop (the row's stop_keeps_memory) makes this stop a pause
        svc.background.start(svc.lifecycle.stop(who, row.id), name=f"stop-{row.id}")
        return {"status": "stopped"}

    @api.post("/boxes/{name}/service-url")
    async def service_url(
        name: str, request: Request, svc: DaemonDep, who: Caller, body: JsonBody
    ) -> Json:
        row = box(svc, who, name, Permission.exec)
        if body.get("access") is not None:
            return login_service_url(request, row.id, body)
        token = svc.ports.mint(
            who,
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
    async def download_url(
        name: str, request: Request, svc: DaemonDep, who: Caller, body: JsonBody
    ) -> Json:
        """cella's download link (`/v1/downloads/...`), made to wake a stopped box."""
        row = box(svc, who, name)
        unknown = set(body) - {"path", "expires_in_seconds", "content_type", "content_disposition"}
        if unknown:
            raise not_supported(f"download links with {sorted(unknown)}")
        if not isinstance(body.get("path"), str) or not body["path"]:
            raise errors.InvalidArgument("a download link needs the file's path")
        for field in ("content_type", "content_disposition"):
            if body.get(field) is not None and not isinstance(body[field], str):
                raise errors.InvalidArgument(f"{field}: a string, not {body[field]!r}")
        expires = body.get("expires_in_seconds")
        if expires is not None and (not isinstance(expires, int) or isinstance(expires, bool)):
            raise errors.InvalidArgument(f"expires_in_seconds: a whole number, not {expires!r}")
        link = svc.downloads.mint(
            who,
            row.id,
            absolute(body["path"]),
            expires,
            content_type=body.get("content_type") or None,
            disposition=body.get("content_disposition") or "attachment",
            wake=True,
        )
        expires_at = None if link.expires_at is None else iso(link.expires_at)
        return {"download_url": link_url(request, link), "token": link.token,
                "expires_at": expires_at}  # fmt: skip

    # -- snapshots ------------------------------------------------------------------------

    @api.post("/boxes/{name}/snapshot")
    async def capture(name: str, svc: DaemonDep, who: Caller, body: JsonBody) -> Json:
        row = box(svc, who, name)
        unknown = set(body) - {
            "name",
            "tag",
            "docker_image",
            "fs_capacity_bytes",
            "run_config",
            "include_memory",
            "checkpoint",
        }
        if unknown:
            raise not_supported(f"capturing a snapshot with {sorted(unknown)}")
        if body.get("checkpoint"):
            raise not_supported(
                f"promoting a checkpoint ({body['checkpoint']!r}); omit it to capture the "
                "running sandbox"
            )
        if not body.get("name"):
            raise errors.InvalidArgument("a snapshot needs a name")
        snap_name, tag = str(body["name"]), str(body.get("tag") or "latest")
        if body.get("docker_image"):  # the image in the sandbox's Docker, not the VM
            snap = svc.images.from_sandbox(
                who,
                row.id,
                snap_name,
                str(body["docker_image"]),
                tag=tag,
                disk_mib=capacity_mib(body),
                defaults=exec_defaults(body.get("run_config")),
            )
            return snapshot_view(svc, who.tenant, snap)
        if body.get("run_config") or body.get("fs_capacity_bytes"):
            raise not_supported("run_config or fs_capacity_bytes on a capture of the running VM")
        snap = await svc.snapshots.snapshot(
            who,
            row.id,
            snap_name,
            tag,
            memory=flag(body, "include_memory") or False,  # LangSmith's default: the disk
        )
        return snapshot_view(svc, who.tenant, snap)

    @api.post("/snapshots")
    async def create_snapshot(svc: DaemonDep, who: Caller, body: JsonBody) -> Json:
        unknown = set(body) - {"name", "docker_image", "fs_capacity_bytes", "tag",
                               "registry_id", "run_config"}  # fmt: skip
        if unknown:
            raise not_supported(f"building a snapshot with {sorted(unknown)}")
        if not body.get("name") or not body.get("docker_image"):
            raise errors.InvalidArgument("a snapshot from an image needs name and docker_image")
        image = str(body["docker_image"])
        registry = None if body.get("registry_id") is None else str(body["registry_id"])
        if registry is not None:
            try:
                svc.image_registries.get(who.tenant, registry)
            except errors.NotFound:
                raise errors.NotFound(f"Registry '{registry}' not found") from None
        snap = svc.images.from_image(
            who.tenant,
            str(body["name"]),
            image,
            tag=str(body.get("tag") or image_tag(image)),
            disk_mib=capacity_mib(body),
            registry=registry,
            defaults=exec_defaults(body.get("run_config")),
        )
        return snapshot_view(svc, who.tenant, snap)

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
        await svc.images.delete(who.tenant, snap.id)
        return Response(status_code=204)

    return api


def login_service_url(request: Request, sandbox_id: str, body: Json) -> Json:
    """A login-mode service URL (cella's `/v1/logins/...`): any key or console session of
    the tenant opens it, and the guest's server gets a signed `X-Langsmith-User-Token`.
    Both of LangSmith's access levels mean the tenant's members here; there is no grant
    to keep, so the token mode stays open beside it."""
    access = body["access"]
    if access not in LOGIN_ACCESS:
        raise errors.InvalidArgument(f"access must be one of {LOGIN_ACCESS}, not {access!r}")
    if body.get("embed_origins"):
        raise not_supported("embedding a login-mode service URL in other origins")
    port = body.get("port")
    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
        raise errors.InvalidArgument(f"port must be 1-65535, got {port!r}")
    url = login_url(request, sandbox_id, port).url
    return {"service_url": url, "browser_url": f"{url}/", "access": access, "embed_origins": []}


def create_spec(svc: Daemon, tenant: str, body: Json) -> SandboxCreate:
    """A LangSmith box create as a cella sandbox create, with what this daemon adds: the
    egress rules (their secrets kept), the snapshot's id, a disk larger than the template's."""
    box = read_create(body)
    auth = dict(box.mount_auth)
    providers = {name.partition(":")[0] for name in auth}
    for rule in (box.proxy_config or {}).get("rules") or []:
        if isinstance(rule, dict) and rule.get("type") in providers and rule.get("enabled"):
            raise errors.InvalidArgument(
                f"{rule['type']} auth cannot be provided in both mount_config and proxy_config"
            )
    network = None if box.proxy_config is None else network_of(box.proxy_config, svc, tenant)
    snapshot_id = None
    if box.snapshot:
        snap = svc.snapshots.resolve(tenant, box.snapshot)
        box.check_snapshot_shape(snap.vcpus, snap.memory_mib)
        snapshot_id = snap.id
    disk_mib = box.fs_capacity_mib
    if disk_mib is not None and disk_mib <= fs_mib(svc, "default"):
        disk_mib = None  # the template's disk is large enough
    opaque = Opaque()
    buckets = bucket_auths(list(box.bucket_mounts), auth, opaque)
    spec = box.spec(
        snapshot_id=snapshot_id, network=network, disk_mib=disk_mib, bucket_mounts=buckets
    )
    opaque.store(svc, tenant)  # only once all of it is valid
    return spec


def bucket_auths(mounts: list[BucketMount], auth: Json, opaque: Opaque) -> list[BucketMount]:
    """The bucket mounts with their auth naming the tenant's secrets: a workspace secret's
    own name, or one new secret per opaque value (bound to the hosts of the mounts that
    use it)."""
    names: dict[str, str] = {}
    for key, (field, given) in auth.items():
        kind = "s3" if key.startswith("aws:") else "gcs"
        hosts = [h for m in mounts if m.type == kind for h in m.hosts]
        names[field] = secret_of(given, field, list(dict.fromkeys(hosts)), opaque)
    out = []
    for mount in mounts:
        if mount.auth is not None and mount.type == "s3":
            keys = {f: names[f] for f in ("access_key_id", "secret_access_key")}
            mount = mount.model_copy(update={"auth": BucketAuth(**keys)})
        elif mount.auth is not None:
            sa = BucketAuth(service_account=names["service_account_json"])
            mount = mount.model_copy(update={"auth": sa})
        out.append(mount)
    return out


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
        fs_mib(svc, snap.template, snap.id),
        svc.snapshots.memory_bytes(snap.id) if snap.memory else None,
    )


def capacity_mib(body: Json) -> int | None:
    """`fs_capacity_bytes` in MiB (rounded up), None when not given."""
    value = body.get("fs_capacity_bytes")
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= 1 << 40:
        raise errors.InvalidArgument("fs_capacity_bytes must be a positive number of bytes")
    return max(-(-value >> 20), 512)


def image_tag(image: str) -> str:
    """The tag an image reference names (`repo:tag`), else `latest`, as LangSmith's is."""
    last = image.rsplit("/", 1)[-1].split("@", 1)[0]
    return last.partition(":")[2] or "latest"


def fs_mib(svc: Daemon, template: str, snapshot_id: str | None = None) -> int:
    """The file system's size: its template's, else (a node that never had the template
    of a snapshot built from an image) that snapshot's disk's."""
    with contextlib.suppress(errors.CellaError):
        return svc.templates.disk_mib(template)
    if snapshot_id:
        with contextlib.suppress(errors.CellaError):
            return svc.snapshots.disk_mib(snapshot_id)
    return 0
