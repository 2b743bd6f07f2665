"""Templates: the built-in ones (`cella setup`), and ones built from OCI images or Dockerfiles.

An image build runs on the host with skopeo and umoci (`cella.images.oci`); a Dockerfile is
untrusted code, so its build runs inside a builder sandbox (buildah, under the builder's
egress rules) and only the resulting image comes out, blob by blob, each checked against its
digest (never an archive for the host to unpack). Either way the template ends
with its warm snapshot made, so the first sandbox of it restores like any other. A template
built from an image carries the image's config: `defaults()` lays it under a new sandbox's
own exec defaults, and `entrypoint()` is what `run_entrypoint` starts.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import shutil
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlsplit

from cella import errors
from cella.config import DaemonSettings
from cella.guest.client import Output
from cella.guest.protocol import ExitStatus
from cella.images import oci
from cella.images.templates import builtin_templates, template_image
from cella.models import (
    ExecDefaults,
    ExecRequest,
    ImageConfig,
    Template,
    TemplateBuild,
)
from cella.policy.access import Principal
from cella.policy.egress import host_matches, parse_rule
from cella.service.egress import SandboxEgress
from cella.service.exec import Exec
from cella.service.files import Files
from cella.service.lifecycle import POOLED_SHAPE, Lifecycle
from cella.service.registry import Registry
from cella.service.warm import Shape, WarmPool, WarmSnapshots

log = logging.getLogger("cella.templates")
Progress = Callable[[str], None]
BUILDER_TEMPLATE = "docker"  # has buildah
BUILD_DIR = "/build"
BUILDAH = ["buildah", "--storage-driver", "vfs"]  # vfs: no overlay mount needed in the guest
OWNED_PREFIX = "img-"  # templates of one tenant's images (snapshots built from images)


class Templates:
    def __init__(
        self,
        settings: DaemonSettings,
        registry: Registry,
        egress: SandboxEgress,
        warm: WarmSnapshots,
        pool: WarmPool,
        lifecycle: Lifecycle,
        exec_room: Exec,
        files: Files,
    ) -> None:
        self.settings = settings
        self.registry = registry
        self.paths = registry.driver.paths
        self.egress = egress
        self.warm = warm
        self.pool = pool
        self.lifecycle = lifecycle
        self.exec = exec_room
        self.files = files
        self._locks: dict[str, asyncio.Lock] = {}
        self._cert_dir: Path | None = None

    # -- reading -------------------------------------------------------------------------

    def list(self, tenant: str | None = None) -> list[Template]:
        """Every template `tenant` may use (None: all of them, every tenant's own too)."""
        out = [
            Template(
                name=spec.name,
                kind="builtin",
                built=template_image(self.paths, spec).exists(),
                disk_mib=spec.disk_mib,
            )
            for spec in builtin_templates().values()
        ]
        metas = oci.list_meta(self.paths)
        return out + [self._of(m) for m in metas if tenant is None or m.tenant in (None, tenant)]

    def get(self, name: str, tenant: str | None = None) -> Template:
        for template in self.list(tenant):
            if template.name == name:
                return template
        raise errors.NotFound(f"no template {name!r}")

    def _of(self, meta: oci.TemplateMeta) -> Template:
        return Template(
            name=meta.name,
            kind=meta.kind,
            source=meta.source,
            digest=meta.digest,
            built=(self.paths.image_templates / meta.image).exists(),
            disk_mib=meta.disk_mib,
            config=meta.config,
            start=meta.start,
            tenant=meta.tenant,
            built_at=datetime.fromtimestamp(meta.built_at, UTC).isoformat(),
            seconds=meta.seconds,
            sha256=meta.sha256,
            shipped_from=meta.shipped_from,
        )

    def disk_mib(self, name: str) -> int:
        """The size of the template's disk in MiB; `NotFound` for an unknown template."""
        return self.registry.driver.template_disk_mib(name)

    def image_config(self, name: str) -> ImageConfig | None:
        meta = oci.read_meta(self.paths, name)
        return meta.config if meta is not None else None

    def defaults(self, name: str, own: ExecDefaults) -> ExecDefaults:
        """A sandbox's exec defaults: its own, over its image's Env, WorkingDir and User."""
        config = self.image_config(name)
        if config is None:
            return own
        return ExecDefaults(
            user=own.user or config.user,
            cwd=own.cwd or config.working_dir,
            env={**config.env, **own.env},
        )

    # -- building ------------------------------------------------------------------------

    async def build_image(self, tenant: str, req: TemplateBuild, progress: Progress) -> Template:
        """A template from an image; ends with its warm snapshot made (after its start
        command, if it has one, is ready)."""
        self.check_name(req.name)
        credentials = self._credentials(tenant, req.registry_secret, req.image)
        async with self.lock(req.name):
            await asyncio.to_thread(
                oci.build_from_image,
                self.paths,
                req.name,
                req.image,
                threadsafe(progress),
                disk_mib=req.disk_mib,
                cert_dir=self.certs(),
                credentials=credentials,
                limits=oci.ImportLimits.of(self.settings),
                start=req.start,
            )
            await self.warm_up(req.name, progress)
        return self.get(req.name)  # with the snapshot's time

    async def run_step(
        self,
        who: Principal,
        sandbox_id: str,
        argv: builtins.list[str],
        progress: Progress,
        step: str | None = None,
    ) -> None:
        """Runs a build step in the builder, its output as progress; fails the build on a
        non-zero exit with the step's last lines."""
        tail: builtins.list[str] = []
        req = ExecRequest(command=argv, timeout=3000, user="root")
        status: ExitStatus | None = None
        pending = b""
        async for event in self.exec.stream(who, sandbox_id, req):
            if isinstance(event, Output):
                pending += event.data
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    text = line.decode(errors="replace").rstrip()
                    if text:
                        progress(f"  {text}")
                        tail = [*tail[-19:], text]
            elif isinstance(event, ExitStatus):
                status = event
        if status is None or status.exit_code != 0:
            code = status.exit_code if status else None
            raise errors.BuildFailed(
                f"the {step or argv[3]} step failed (exit {code}): " + " / ".join(tail[-5:])
            )

    async def warm_up(self, name: str, progress: Progress) -> None:
        """The new build replaces the old in pools and warm snapshots; then its own warm
        snapshot is made, so the first sandbox restores rather than boots."""
        await self.pool.forget(name)
        progress("making the warm snapshot (one boot)")
        started = time.monotonic()
        await self.warm.ensure(Shape(name, *POOLED_SHAPE))
        seconds = round(time.monotonic() - started, 2)
        meta = oci.read_meta(self.paths, name)
        if meta is not None:
            oci.record_seconds(self.paths, meta, snapshot=seconds)
        progress(f"template {name} is ready ({seconds} s to snapshot)")

    # -- removing ------------------------------------------------------------------------

    async def delete(self, name: str) -> None:
        """Removes a template built from an image; refused while sandboxes or snapshots
        of it exist (their disks sit on its base)."""
        if name in builtin_templates():
            raise errors.InvalidArgument(f"{name!r} is a built-in template")
        meta = oci.read_meta(self.paths, name)
        if meta is None:
            raise errors.NotFound(f"no template {name!r}")
        gone = ("deleted", "error")
        users = [
            r.id
            for r in self.registry.store.list_sandboxes()
            if r.template == name and r.state not in gone
        ]
        snaps = [
            s.id
            for s in self.registry.store.list_snapshots()
            if s.template == name and s.state not in gone
        ]
        if users or snaps:
            raise errors.Conflict(
                f"template {name!r} is in use by {len(users)} sandbox(es) and "
                f"{len(snaps)} snapshot(s): delete those first"
            )
        async with self.lock(name):
            await self.pool.forget(name)
            oci.meta_path(self.paths, name).unlink(missing_ok=True)
            for warm in self.paths.warm_snapshots(builtin=False).glob(f"{name}-*"):
                shutil.rmtree(warm, ignore_errors=True)
            if all(m.image != meta.image for m in oci.list_meta(self.paths)):
                (self.paths.image_templates / meta.image).unlink(missing_ok=True)

    async def delete_owned(self, tenant: str, name: str) -> None:
        """Removes one of `tenant`'s own templates once nothing is built on it (nothing
        happens while something is, or when it is not the tenant's)."""
        meta = oci.read_meta(self.paths, name)
        if meta is None or meta.tenant != tenant:
            return
        with contextlib.suppress(errors.Conflict, errors.NotFound):
            await self.delete(name)

    # -- helpers -------------------------------------------------------------------------

    def check_name(self, name: str) -> None:
        if name in builtin_templates():
            raise errors.InvalidArgument(f"{name!r} is a built-in template (`cella setup`)")
        if oci.owner_of(self.paths, name) is not None or name.startswith(OWNED_PREFIX):
            raise errors.InvalidArgument(f"{name!r} is a name of one tenant's image templates")

    def lock(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())

    def _credentials(self, tenant: str, secret: str | None, image: str) -> str | None:
        """`user:password` for the image's registry, from a secret bound to its host (a
        secret is never sent to a host it is not bound to)."""
        if secret is None:
            return None
        row = self.registry.store.get_secret(tenant, secret)
        if row is None:
            raise errors.InvalidArgument(f"no secret {secret!r}")
        if ":" not in row.value:
            raise errors.InvalidArgument(f"secret {secret!r} must be `user:password`")
        source = oci.skopeo_source(image)
        if not source.startswith("docker://"):
            raise errors.InvalidArgument("registry_secret is for images from a registry")
        host = urlsplit("//" + source.removeprefix("docker://").split("/", 1)[0]).hostname
        if not host or not host_matches([parse_rule(h) for h in row.hosts], host):
            raise errors.InvalidArgument(f"secret {secret!r} is not bound to {host}")
        return row.value

    def certs(self) -> Path | None:
        """The operator's extra CAs as a directory skopeo reads (`*.crt`)."""
        pem = self.settings.extra_ca_pem()
        if not pem:
            return None
        if self._cert_dir is None:
            self._cert_dir = self.paths.root / "registry-certs"
            self._cert_dir.mkdir(exist_ok=True)
            (self._cert_dir / "extra.crt").write_bytes(pem)
        return self._cert_dir


def threadsafe(progress: Progress) -> Progress:
    """`progress` callable from a worker thread (it runs on the event loop)."""
    loop = asyncio.get_running_loop()

    def call(line: str) -> None:
        loop.call_soon_threadsafe(progress, line)

    return call
