"""Snapshots built from images: an image in a registry (pulled in a builder sandbox, with
one of the tenant's registries: `image_pulls`), or an image in a sandbox's own Docker
(`docker save` there).

Either way the image becomes a template of that tenant's alone (`img-...`: other tenants
cannot see or create from it; its base file is shared by manifest digest underneath, and only
after the tenant has fetched the image with its own access), a sandbox boots from it with the
image's USER, WORKDIR and ENV (under the caller's `run_config`), and that sandbox is
snapshotted. The snapshot row exists from the first moment, `creating`, so a client polls it
as it would any build; a failure leaves it `error` with the reason, and the template goes.

The snapshot's disk stands alone: the image's blocks (the template's base and its warm
snapshot's disk, which no other host has) are written into it before it is ready, so any
node with the snapshot's files and the kernel boots it. Its forks share its disk as any
fork does; what it does not share is the template base's blocks (the building node keeps
both while the template lives, which is as long as the snapshot).
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import os
import re
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from cella import errors
from cella.images import docker_save, oci
from cella.models import ExecDefaults, SandboxCreate, Template
from cella.policy.access import Principal
from cella.service.background import Background
from cella.service.image_pulls import ImagePulls
from cella.service.image_registries import ImageRegistries
from cella.service.lifecycle import Lifecycle
from cella.service.registry import error_text
from cella.service.snapshots import Snapshots
from cella.service.templates import OWNED_PREFIX, Progress, Templates, threadsafe
from cella.store import SnapshotRecord

log = logging.getLogger("cella.images")
Build = Callable[[str, Progress], Awaitable[Template]]  # (template name, progress)


class ImageSnapshots:
    def __init__(
        self,
        templates: Templates,
        lifecycle: Lifecycle,
        snapshots: Snapshots,
        registries: ImageRegistries,
        background: Background,
    ) -> None:
        self.templates = templates
        self.lifecycle = lifecycle
        self.snapshots = snapshots
        self.registries = registries
        self.background = background
        self.pulls = ImagePulls(templates)

    def from_image(
        self,
        tenant: str,
        name: str,
        image: str,
        *,
        tag: str | None = None,
        disk_mib: int | None = None,
        registry: str | None = None,
        defaults: ExecDefaults | None = None,
    ) -> SnapshotRecord:
        """Starts building snapshot `name` from the registry image `image`; returns its row,
        `creating`. A registry that is not the tenant's, or not the image's host, is refused
        here; a pull the registry refuses fails the snapshot."""
        image = registry_reference(image)  # never a path or another transport on the host
        credentials = None
        if registry is not None:
            credentials = self.registries.credentials(tenant, registry, image)
        self.pulls.check(tenant, image)

        async def build(template: str, progress: Progress) -> Template:
            limits = oci.ImportLimits.of(self.templates.settings)
            with tempfile.TemporaryDirectory(dir=self.templates.paths.build_tmp) as tmp:
                layout = await self.pulls.pull(
                    tenant, image, credentials, Path(tmp), limits, progress,
                    labels={"cella.snapshot": name},
                )  # fmt: skip
                await self._template_from(layout, template, tenant, image, limits, disk_mib,
                                          progress)  # fmt: skip
            return await self._warm(template, tenant, progress)

        return self._start(tenant, name, tag, defaults, build)

    def from_sandbox(
        self,
        who: Principal,
        sandbox_id: str,
        name: str,
        docker_image: str,
        *,
        tag: str | None = None,
        disk_mib: int | None = None,
        defaults: ExecDefaults | None = None,
    ) -> SnapshotRecord:
        """Starts building snapshot `name` from `docker_image` in the running sandbox's own
        Docker (a caller who may exec in it); returns its row, `creating`."""
        tenant = who.tenant
        self.lifecycle.registry.live(who, sandbox_id)  # NotFound, not permitted, not running
        if not docker_image or docker_image.startswith("-") or "\x00" in docker_image:
            raise errors.InvalidArgument(f"{docker_image!r} is not a Docker image name")

        async def build(template: str, progress: Progress) -> Template:
            where = f"{docker_save.EXPORT_DIR}-{template}"
            argv = ["sh", "-c", docker_save.EXPORT_SH, "export", docker_image, where,
                    docker_save.DOCKER_SAVE_TO_OCI]  # fmt: skip
            try:
                await self.templates.run_step(who, sandbox_id, argv, progress, "docker save")
                limits = oci.ImportLimits.of(self.templates.settings)
                with tempfile.TemporaryDirectory(dir=self.templates.paths.build_tmp) as tmp:

                    async def read(path: str) -> AsyncIterator[bytes]:
                        return await self.templates.files.read(who, sandbox_id, path)

                    layout = await oci.copy_layout(read, f"{where}/layout", Path(tmp), limits)
                    source = f"{docker_image} (Docker of sandbox {sandbox_id})"
                    await self._template_from(layout, template, tenant, source, limits,
                                              disk_mib, progress)  # fmt: skip
            finally:
                with contextlib.suppress(errors.CellaError):
                    await self.templates.run_step(who, sandbox_id, ["rm", "-rf", "--", where],
                                                  progress, "cleanup")  # fmt: skip
            return await self._warm(template, tenant, progress)

        return self._start(tenant, name, tag, defaults, build)

    def defaults(self, tenant: str, ref: str, own: ExecDefaults) -> ExecDefaults:
        """A new sandbox's exec defaults when it comes from snapshot `ref`: its own, over
        those of a snapshot built from an image (the image's USER, WORKDIR and ENV under the
        build's run_config), as a sandbox of the image's template would have them."""
        snap = self.snapshots.resolve(tenant, ref)
        if not snap.template.startswith(OWNED_PREFIX) or not snap.sandbox_id:
            return own
        image = self.snapshots.source_of(snap)[0].exec_defaults
        return ExecDefaults(
            user=own.user or image.user, cwd=own.cwd or image.cwd, env={**image.env, **own.env}
        )

    async def delete(self, tenant: str, snapshot_id: str) -> None:
        """Deletes the snapshot, and its image's template once nothing else is built on it."""
        snap = self.snapshots.get(tenant, snapshot_id)
        await self.snapshots.delete(tenant, snapshot_id)
        await self._forget(tenant, snap.template)

    # -- the build ----------------------------------------------------------------------

    async def _template_from(
        self,
        layout: str,
        template: str,
        tenant: str,
        source: str,
        limits: oci.ImportLimits,
        disk_mib: int | None,
        progress: Progress,
    ) -> None:
        """The tenant's own template `template` from the OCI layout an image came out as
        (pulled from a registry, or saved from a sandbox's Docker)."""
        async with self.templates.lock(template):
            await asyncio.to_thread(
                oci.build_from_image,
                self.templates.paths,
                template,
                layout,
                threadsafe(progress),
                disk_mib=disk_mib,
                source=source,
                limits=limits,
                tenant=tenant,
            )

    async def _warm(self, template: str, tenant: str, progress: Progress) -> Template:
        """The template's warm snapshot made (the builder sandbox restores from it)."""
        async with self.templates.lock(template):
            await self.templates.warm_up(template, progress)
        return self.templates.get(template, tenant)

    def _start(
        self,
        tenant: str,
        name: str,
        tag: str | None,
        defaults: ExecDefaults | None,
        build: Build,
    ) -> SnapshotRecord:
        template = f"{OWNED_PREFIX}{os.urandom(8).hex()}"
        record = self.snapshots.begin(tenant, name, template)
        work = self._finish(tenant, record, tag, defaults or ExecDefaults(), build)
        self.background.start(work, name=f"image-snapshot-{record.id}")
        return record

    async def _finish(
        self,
        tenant: str,
        record: SnapshotRecord,
        tag: str | None,
        defaults: ExecDefaults,
        build: Build,
    ) -> None:
        lines: builtins.list[str] = []

        def progress(line: str) -> None:
            lines.append(line)
            log.debug("snapshot %s: %s", record.id, line)

        try:
            template = await build(record.template, progress)
            spec = SandboxCreate(
                template=template.name,
                exec_defaults=self.templates.defaults(template.name, defaults),
                labels={"cella.role": "snapshot-builder", "cella.snapshot": record.id},
            )
            builder = Principal.service(tenant)  # the tenant's, as the snapshot is
            box = await self.lifecycle.create(builder, spec)
            try:
                await self.snapshots.snapshot(
                    builder, box.id, record.name, tag, into=record, standalone=True
                )
            finally:
                with contextlib.suppress(errors.CellaError):
                    await self.lifecycle.delete(builder, box.id)
                # sandboxes come from the snapshot, never from the template: no pool of it
                await self.templates.pool.forget(template.name)
        except BaseException as exc:
            log.info("snapshot %s from an image failed: %s", record.id, exc)
            self.snapshots.store.update_snapshot(record.id, state="error", error=error_text(exc))
            with contextlib.suppress(Exception):
                await self._forget(tenant, record.template)
            if not isinstance(exc, Exception):
                raise

    async def _forget(self, tenant: str, template: str) -> None:
        if template.startswith(OWNED_PREFIX):
            await self.templates.delete_owned(tenant, template)


_REFERENCE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:@+-]{0,1023}")
_TRANSPORTS = ("oci:", "oci-archive:", "docker-archive:", "dir:", "docker-daemon:",
               "containers-storage:", "sif:", "tarball:")  # fmt: skip


def registry_reference(image: str) -> str:
    """`image` as a registry reference (`host/repo:tag`, `...@sha256:...`); anything that
    could name a file or another transport on the host is refused."""
    ref = image.removeprefix("docker://")
    if not _REFERENCE.fullmatch(ref) or ".." in ref or ref.startswith(_TRANSPORTS):
        raise errors.InvalidArgument(f"{image!r} is not a registry image reference")
    return ref
