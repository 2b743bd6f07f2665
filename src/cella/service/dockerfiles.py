"""Templates from a Dockerfile and its context, built by buildah in a builder sandbox.

A Dockerfile is untrusted code: it runs in a sandbox of the `docker` template (buildah, vfs
storage, chroot isolation) under that sandbox's egress rules, and only the resulting image
comes out, blob by blob, each checked against its digest (never an archive for the host to
unpack). Archives the context carries for the build (`prepare`) are unpacked in the builder
too. The template may be one tenant's alone (`tenant`), and may have a start command its
sandboxes have running from their warm snapshot (`StartCommand`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import tempfile
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from cella import errors
from cella.images import oci
from cella.models import NetworkPolicy, SandboxCreate, StartCommand, Template
from cella.policy.access import Principal
from cella.service.templates import (
    BUILD_DIR,
    BUILDAH,
    BUILDER_TEMPLATE,
    Progress,
    Templates,
    threadsafe,
)

AUTH_FILE = "/var/tmp/cella-build-auth.json"  # a file, not an argument: arguments are traced


@dataclass(frozen=True, slots=True)
class DockerfileBuild:
    """How a context is built: its Dockerfile's path in it, what the builder may reach,
    the file system's size (and the least it has free), whose template it is (None: every
    tenant's), what it starts, commands run in the builder (in the context's directory)
    before buildah, and `user:password` for one registry host."""

    dockerfile: str = "Dockerfile"
    allow: list[str] = field(default_factory=list)
    disk_mib: int | None = None
    tenant: str | None = None
    start: StartCommand | None = None
    prepare: list[list[str]] = field(default_factory=list)
    registry: tuple[str, str] | None = None
    labels: dict[str, str] = field(default_factory=dict)
    free_mib: int = oci.HEADROOM_MIB


class Dockerfiles:
    def __init__(self, templates: Templates) -> None:
        self.templates = templates

    async def build(
        self,
        tenant: str,
        name: str,
        context: AsyncIterable[bytes],
        progress: Progress,
        how: DockerfileBuild | None = None,
    ) -> Template:
        """A template `name` from a Dockerfile and its context (a tar stream), built by
        buildah in a builder sandbox of `tenant` that reaches only `how.allow`; ends with
        its warm snapshot made."""
        how = how or DockerfileBuild()
        t = self.templates
        if how.tenant is None:
            t.check_name(name)
        path = how.dockerfile
        if path.startswith("/") or ".." in path.split("/") or "\x00" in path:
            raise errors.InvalidArgument("dockerfile must be a path inside the context")
        try:
            t.registry.driver.template_disk_mib(BUILDER_TEMPLATE)
        except errors.ImageMissing:
            raise errors.ImageMissing(
                "the docker template (the builder) is not built: "
                "run `cella setup --template docker`"
            ) from None
        spec = SandboxCreate(  # the pooled shape: restored from the template's warm snapshot
            template=BUILDER_TEMPLATE,
            ttl_seconds=3600,
            labels={"cella.role": "template-builder", "cella.template": name, **how.labels},
            network=NetworkPolicy(allow=how.allow),
        )
        progress(f"starting a builder sandbox (egress: {', '.join(how.allow) or 'none'})")
        builder = Principal.service(tenant)  # the builder is the tenant's, as a template is
        box = await t.lifecycle.create(builder, spec)
        digest = hashlib.sha256()
        try:

            async def hashed() -> AsyncIterator[bytes]:
                async for chunk in context:
                    digest.update(chunk)
                    yield chunk

            progress("uploading the build context")
            where = f"{BUILD_DIR}/context"
            await t.files.upload_archive(builder, box.id, where, hashed())
            source = f"Dockerfile (context sha256:{digest.hexdigest()[:16]})"
            for argv in how.prepare:
                await t.run_step(builder, box.id, ["sh", "-c", 'cd "$0" && exec "$@"', where,
                                 *argv], progress, "prepare")  # fmt: skip
            bud = [*BUILDAH, "bud", "--isolation", "chroot", "--layers=false"]
            if how.registry is not None:
                host, credentials = how.registry
                auth = oci.auth_json(host, credentials).encode()
                await t.files.write(builder, box.id, AUTH_FILE, _once(auth), mode=0o600)
                bud += ["--authfile", AUTH_FILE]
            progress("building the image (buildah)")
            await t.run_step(builder, box.id, [*bud, "-f", f"{where}/{path}", "-t", "cella-build",
                             where], progress, "bud")  # fmt: skip
            progress("exporting the image")
            await t.run_step(builder, box.id, [*BUILDAH, "push", "cella-build",
                             f"oci:{BUILD_DIR}/layout:cella-build"], progress, "push")  # fmt: skip
            limits = oci.ImportLimits.of(t.settings)
            with tempfile.TemporaryDirectory(dir=t.paths.build_tmp) as tmp:

                async def read(file: str) -> AsyncIterator[bytes]:
                    return await t.files.read(builder, box.id, file)

                # blob by blob, checked: what the builder made is the guest's, and an
                # archive of it would be unpacked on the host
                image = await oci.copy_layout(read, f"{BUILD_DIR}/layout", Path(tmp), limits)
                async with t.lock(name):
                    await asyncio.to_thread(
                        oci.build_from_image,
                        t.paths,
                        name,
                        image,
                        threadsafe(progress),
                        disk_mib=how.disk_mib,
                        kind="dockerfile",
                        source=source,
                        limits=limits,
                        tenant=how.tenant,
                        start=how.start,
                        free_mib=how.free_mib,
                    )
        finally:
            with contextlib.suppress(errors.CellaError):
                await t.lifecycle.delete(builder, box.id)
        async with t.lock(name):
            await t.warm_up(name, progress)
        return t.get(name, how.tenant)


async def _once(data: bytes) -> AsyncIterator[bytes]:
    yield data
