"""Templates built from steps: a tenant's named templates, each build of one a template of
that tenant's alone (E2B's `Template` builder, through its build API).

A build is requested (a named template, made on first use, and a build of it, `waiting`),
its files are uploaded by hash through signed, expiring links, then it is started with its
base and steps: they become a Dockerfile (`images.steps`) and a context holding the
uploaded archives, built by buildah in a builder sandbox of the tenant (`Dockerfiles`),
which reaches the public network through the egress proxy as every sandbox does (within the
operator's boundary). Its log is kept (and stored when it ends) for the client that polls
it; tags name builds, `default` the latest. A registry password lives only as long as the
build that uses it; a build a restart cut short ends `error`.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import re
import secrets
import string
import tarfile
import tempfile
import time
import uuid
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import IO, Any

from cella import errors
from cella.images import steps as translate
from cella.images.oci import HEADROOM_MIB
from cella.models import StartCommand, StepBuild
from cella.service.background import Background
from cella.service.dockerfiles import DockerfileBuild, Dockerfiles
from cella.service.image_registries import image_host
from cella.service.signing import Signer
from cella.service.template_files import TemplateFiles
from cella.service.templates import OWNED_PREFIX, Templates
from cella.store import (
    NamedTemplateRecord,
    SandboxRecord,
    SnapshotRecord,
    Store,
    TemplateBuildRecord,
)

DEFAULT_TAG = "default"
MAX_FREE_MIB = 1 << 20
UPLOAD_AUDIENCE = "cella:template-files"
UPLOAD_SECONDS = 3600
MAX_LOG_ENTRIES = 20000
_STEP = re.compile(r"STEP (\d+)/\d+:")
_ID = string.ascii_lowercase + string.digits


@dataclass(frozen=True, slots=True)
class Resolved:
    """What a sandbox of a named template starts from: the cella template of the build a
    tag names, and the shape the build asked for."""

    template: str
    vcpus: int | None
    memory_mib: int | None


class TemplateBuilds:
    def __init__(
        self,
        store: Store,
        templates: Templates,
        dockerfiles: Dockerfiles,
        background: Background,
        signer: Signer,
        files: TemplateFiles,
    ) -> None:
        self.store = store
        self.templates = templates
        self.dockerfiles = dockerfiles
        self.background = background
        self.signer = signer
        self.files = files
        self._logs: dict[str, list[dict[str, str]]] = {}  # builds running now

    # -- names, builds and their files ----------------------------------------------------

    def request(
        self,
        tenant: str,
        name: str,
        tags: list[str],
        vcpus: int | None = None,
        memory_mib: int | None = None,
        free_mib: int | None = None,
    ) -> tuple[NamedTemplateRecord, TemplateBuildRecord, list[str]]:
        """A new build (`waiting`) of the tenant's template `name` (`name:tag` adds a tag),
        made on first use; the tags it will carry once ready (`default` without any); its
        sandboxes' shape and the least its file system has free."""
        name, _, tag = name.partition(":")
        wanted = list(dict.fromkeys([*([tag] if tag else []), *tags])) or [DEFAULT_TAG]
        translate.check_name(name)
        for t in wanted:
            translate.check_tag(t)
        named = self.store.named_template(tenant, name)
        if named is None:
            new_id = "".join(secrets.choice(_ID) for _ in range(20))
            named = self.store.add_named_template(NamedTemplateRecord(new_id, tenant, name))
        if free_mib is not None and not 0 <= free_mib <= MAX_FREE_MIB:
            raise errors.InvalidArgument(f"the free space asked for is 0-{MAX_FREE_MIB} MiB")
        shape = {"vcpus": vcpus, "memory_mib": memory_mib, "tags": wanted, "free_mib": free_mib}
        build = self.store.insert_build(
            TemplateBuildRecord(str(uuid.uuid4()), named.id, tenant, spec=json.dumps(shape))
        )
        return named, build, wanted

    def named(self, tenant: str, ref: str) -> NamedTemplateRecord:
        """The tenant's template by id or name (a `:tag` is ignored)."""
        named = self.store.named_template(tenant, ref.partition(":")[0])
        if named is None:
            raise errors.NotFound(f"template {ref!r} not found")
        return named

    def build(self, tenant: str, template_id: str, build_id: str) -> TemplateBuildRecord:
        named = self.named(tenant, template_id)
        row = self.store.get_build(build_id)
        if row is None or row.template_id != named.id:
            raise errors.NotFound(f"build {build_id} of template {template_id} not found")
        return row

    def upload_token(self, tenant: str, template_id: str, files_hash: str) -> tuple[bool, str]:
        """Whether the files of `files_hash` are here already, and a token that lets its
        holder upload them (once, for an hour) without a key."""
        named = self.named(tenant, template_id)
        translate.check_hash(files_hash)
        now = int(time.time())
        token = self.signer.sign(
            {"aud": UPLOAD_AUDIENCE, "sub": named.id, "ten": tenant, "hash": files_hash,
             "iat": now, "exp": now + UPLOAD_SECONDS}
        )  # fmt: skip
        return self.files.present(tenant, files_hash), token

    async def receive(
        self, token: str, template_id: str, files_hash: str, body: AsyncIterable[bytes]
    ) -> None:
        """Keeps an upload a link made by `upload_token` was used for (a tar archive,
        maybe gzipped: unpacked only in a builder sandbox)."""
        claims = self.signer.verify(token, audience=UPLOAD_AUDIENCE, required=["sub", "hash"])
        if claims["sub"] != template_id or claims["hash"] != files_hash:
            raise errors.PermissionDenied("this upload link is for other files")
        await self.files.receive(str(claims["ten"]), files_hash, body)

    # -- building -------------------------------------------------------------------------

    def start(
        self,
        tenant: str,
        template_id: str,
        build_id: str,
        spec: StepBuild,
        credentials: str | None = None,
    ) -> None:
        """Starts the build `waiting` for its steps; refused at once, naming it, for what
        cannot be built (a missing upload, a step cella cannot write, a base that is not a
        template built from steps)."""
        row = self.build(tenant, template_id, build_id)
        if row.state != "waiting":
            raise errors.Conflict(f"build {build_id} was started already ({row.state})")
        image, steps, start = self._expand(tenant, spec, credentials)
        done = translate.dockerfile(image, steps)
        missing = [h for h in done.hashes if not self.files.present(tenant, h)]
        if missing:
            raise errors.InvalidArgument(f"files not uploaded for the copy steps: {missing}")
        registry = (image_host(image), credentials) if credentials else None
        # kept expanded (a base template's steps in it): a later build on this one reads
        # its image and steps, never a name that may name another build by then
        flat = StepBuild(from_image=image, steps=steps, start=start)
        kept = {**json.loads(row.spec), **flat.model_dump(mode="json"), "registry": bool(registry)}
        self.store.update_build(build_id, state="building", spec=json.dumps(kept))
        self._logs[build_id] = []
        self._log(build_id, "info", f"building {image} with {len(spec.steps)} step(s)")
        work = self._run(tenant, row, done, flat, registry)
        self.background.start(work, name=f"template-build-{build_id}")

    def _expand(
        self, tenant: str, spec: StepBuild, credentials: str | None
    ) -> tuple[str, list[Any], StartCommand | None]:
        """The base image, every step (those of a `from_template` base first) and the start
        command (the base's unless the build has its own)."""
        if (spec.from_image is None) == (spec.from_template is None):
            raise errors.InvalidArgument("exactly one of fromImage and fromTemplate is needed")
        if spec.from_image is not None:
            image = translate.reference(spec.from_image, image_host(spec.from_image))
            return image, list(spec.steps), spec.start
        if credentials:
            raise errors.InvalidArgument("registry credentials go with fromImage only")
        ref = spec.from_template or ""
        base = self._tagged(tenant, ref)
        if base is None:
            raise errors.InvalidArgument(
                f"not supported by cella: fromTemplate {ref!r}, which is not a template "
                "built from steps (only those can be a base)"
            )
        kept = json.loads(base.spec)
        had = StepBuild.model_validate(
            {k: v for k, v in kept.items() if k in StepBuild.model_fields}
        )
        if kept.get("registry"):
            raise errors.InvalidArgument(f"{ref!r} was built from a private registry's image")
        image, steps, start = self._expand(tenant, had, None)
        return image, [*steps, *spec.steps], spec.start or start

    async def _run(
        self,
        tenant: str,
        row: TemplateBuildRecord,
        done: translate.Translated,
        spec: StepBuild,
        registry: tuple[str, str] | None,
    ) -> None:
        build_id = row.id
        image = f"{OWNED_PREFIX}{os.urandom(8).hex()}"
        step = ["base"]

        def progress(line: str) -> None:
            if m := _STEP.search(line):
                n = int(m.group(1))
                step[0] = done.origins[n - 1] if 0 < n <= len(done.origins) else "finalize"
            elif "warm snapshot" in line:
                step[0] = "finalize"
            self._log(build_id, "info", line.strip())

        try:
            with tempfile.TemporaryFile(dir=self.templates.paths.build_tmp) as context:
                await asyncio.to_thread(self._context, tenant, done, context)
                prepare = [["sh", "-c", f"mkdir -p files/{h} && tar -xf files/{h}.tar -C "
                            f"files/{h} && rm files/{h}.tar"] for h in done.hashes]  # fmt: skip
                how = DockerfileBuild(
                    allow=["*"],  # as a registry pull: every public host, none beyond
                    tenant=tenant,
                    start=spec.start,
                    prepare=prepare,
                    registry=registry,
                    labels={"cella.build": build_id},
                    free_mib=json.loads(row.spec).get("free_mib") or HEADROOM_MIB,
                )
                await self.dockerfiles.build(tenant, image, _chunks(context), progress, how)
        except BaseException as exc:
            message = exc.message if isinstance(exc, errors.CellaError) else repr(exc)
            self._log(build_id, "error", message)
            self._end(build_id, state="error", error=message, step=step[0])
            with contextlib.suppress(Exception):
                await self.templates.delete_owned(tenant, image)
            if not isinstance(exc, Exception):
                raise
            return
        self._log(build_id, "info", f"build {build_id} is ready")
        for tag in json.loads(row.spec).get("tags") or [DEFAULT_TAG]:
            self.store.set_template_tag(row.template_id, tag, build_id)
        self._end(build_id, state="ready", image=image)
        await self._forget_untagged(tenant, row.template_id)

    def _context(self, tenant: str, done: translate.Translated, out: IO[bytes]) -> None:
        """The build context: the Dockerfile and each upload, as it came."""
        with tarfile.open(fileobj=out, mode="w") as tar:
            data = done.dockerfile.encode()
            info = tarfile.TarInfo("Dockerfile")
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
            for h in done.hashes:
                tar.add(self.files.path(tenant, h), arcname=f"{translate.FILES}/{h}.tar")
        out.seek(0)

    def _log(self, build_id: str, level: str, message: str) -> None:
        entries = self._logs.setdefault(build_id, [])
        if len(entries) < MAX_LOG_ENTRIES and message:
            stamp = datetime.now(UTC).isoformat().replace("+00:00", "Z")
            entries.append({"timestamp": stamp, "level": level, "message": message})

    def _end(self, build_id: str, **fields: Any) -> None:
        logs = self._logs.get(build_id, [])
        self.store.update_build(build_id, logs=json.dumps(logs), **fields)
        self._logs.pop(build_id, None)  # after the store has them: a poll never sees none

    def logs(self, row: TemplateBuildRecord) -> list[dict[str, str]]:
        """The build's log so far (the stored one once it ended)."""
        running = self._logs.get(row.id)
        return list(running) if running is not None else json.loads(row.logs)

    def recover(self) -> None:
        """Builds a restart cut short end `error`."""
        for row in self.store.builds_in(["building"]):
            self._end(row.id, state="error", error="the daemon restarted during the build")

    # -- tags, lookups, removal -----------------------------------------------------------

    def _tagged(self, tenant: str, ref: str) -> TemplateBuildRecord | None:
        """The ready build `ref` (an id or name, with an optional `:tag`) names; None when
        no template built from steps has that id or name."""
        key, _, tag = ref.partition(":")
        named = self.store.named_template(tenant, key)
        if named is None:
            return None
        tags = {t: b for t, b, _ in self.store.template_tags(named.id)}
        build = self.store.get_build(tags.get(tag or DEFAULT_TAG, ""))
        if build is None or build.state != "ready":
            raise errors.NotFound(f"template {ref!r} has no ready build tagged {tag or 'default'}")
        return build

    def resolve(self, tenant: str, ref: str) -> Resolved | None:
        """The template a sandbox of `ref` starts from (None: not one built from steps)."""
        build = self._tagged(tenant, ref)
        if build is None or build.image is None:
            return None
        shape = json.loads(build.spec)
        return Resolved(build.image, shape.get("vcpus"), shape.get("memory_mib"))

    def tags(self, tenant: str, ref: str) -> list[tuple[str, str, str]]:
        return self.store.template_tags(self.named(tenant, ref).id)

    def assign(self, tenant: str, target: str, tags: list[str]) -> tuple[str, list[str]]:
        """Points `tags` at the build `target` (`name:tag`) names; returns its id."""
        for tag in tags:
            translate.check_tag(tag)
        build = self._tagged(tenant, target)
        if build is None:
            raise errors.NotFound(f"template {target!r} not found")
        for tag in tags:
            self.store.set_template_tag(build.template_id, tag, build.id)
        return build.id, tags

    async def remove_tags(self, tenant: str, name: str, tags: list[str]) -> None:
        named = self.named(tenant, name)
        missing = [t for t in tags if not self.store.delete_template_tag(named.id, t)]
        if missing:
            raise errors.NotFound(f"template {name!r} has no tag(s) {missing}")
        await self._forget_untagged(tenant, named.id)

    async def delete(self, tenant: str, ref: str) -> bool:
        """Removes the tenant's template `ref` with its builds (409 while sandboxes or
        snapshots are built on one); False when no template built from steps is `ref`."""
        named = self.store.named_template(tenant, ref.partition(":")[0])
        if named is None:
            return False
        images = [b.image for b in self.store.builds_of(named.id) if b.image]
        rows: list[SandboxRecord | SnapshotRecord] = [
            *self.store.list_sandboxes(tenant), *self.store.list_snapshots(tenant)
        ]  # fmt: skip
        users = [r.id for r in rows if r.template in images and r.state not in ("deleted", "error")]
        if users:
            raise errors.Conflict(f"template {ref!r} is in use by {users}: delete those first")
        for image in images:
            await self.templates.delete_owned(tenant, image)
        self.store.delete_named_template(named.id)
        return True

    async def _forget_untagged(self, tenant: str, template_id: str) -> None:
        """Removes the templates of builds no tag names any more (unless in use)."""
        tagged = {b for _, b, _ in self.store.template_tags(template_id)}
        for build in self.store.builds_of(template_id):
            if build.image and build.id not in tagged and build.state == "ready":
                await self.templates.delete_owned(tenant, build.image)

    def listed(self, tenant: str) -> list[tuple[NamedTemplateRecord, list[TemplateBuildRecord]]]:
        return [(n, self.builds(n)) for n in self.store.named_templates(tenant)]

    def builds(self, named: NamedTemplateRecord) -> list[TemplateBuildRecord]:
        return self.store.builds_of(named.id)


async def _chunks(spool: IO[bytes]) -> AsyncIterator[bytes]:
    while chunk := await asyncio.to_thread(spool.read, 1 << 20):
        yield chunk
