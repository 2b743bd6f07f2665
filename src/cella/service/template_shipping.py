"""Template shipping: a template built from an image, moved between the nodes of a fleet by
its content digest, never built again.

The sending node says what the template is (`export`: its record, and its base image's
SHA-256 and size, computed once and kept in the record) and hands out the base; the
receiving node (`take_in`) pulls the base beside its templates, checks size and digest, and
only then renames it into place and writes the record: a truncated or altered copy is
deleted and refused (`TemplateCorrupt`), and nothing of it is left to boot from. A copy
already here with the same digest is kept as it is.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path

from cella import errors
from cella.images import oci
from cella.images.templates import builtin_templates
from cella.models import Template
from cella.models.fleet import TemplateExport
from cella.paths import Paths
from cella.service.templates import Templates

_BASE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}\.qcow2$")  # a plain name, no path
Pull = Callable[[Path], Awaitable[None]]


class TemplateShipping:
    def __init__(self, paths: Paths, templates: Templates) -> None:
        self.paths = paths
        self.templates = templates

    def _meta(self, name: str) -> oci.TemplateMeta:
        if name in builtin_templates():
            raise errors.InvalidArgument(
                f"{name!r} is a built-in template: every node builds it (`cella setup`)"
            )
        meta = oci.read_meta(self.paths, name)
        if meta is None:
            raise errors.NotFound(f"no template {name!r}")
        if not (self.paths.image_templates / meta.image).exists():
            raise errors.ImageMissing(f"template {name!r} has no base image here")
        return meta

    def base(self, name: str) -> Path:
        """The template's base image, to send to another node."""
        return self.paths.image_templates / self._meta(name).image

    async def export(self, name: str) -> TemplateExport:
        """What another node needs to take the template in (its digest computed once)."""
        meta = self._meta(name)
        base = self.paths.image_templates / meta.image
        sha256 = meta.sha256
        if sha256 is None:  # built before templates carried their digest
            sha256 = await asyncio.to_thread(oci.file_sha256, base)
            meta = meta.model_copy(update={"sha256": sha256})
            oci.write_meta(self.paths, meta)
        return TemplateExport(
            template=meta.model_dump(mode="json"), sha256=sha256, bytes=base.stat().st_size
        )

    async def take_in(
        self, export: TemplateExport, pull: Pull, source_node: str | None
    ) -> Template:
        """Another node's template made local: its base pulled (`pull(destination)`),
        checked against the export's size and digest, then its record written."""
        meta = oci.TemplateMeta.model_validate(export.template)
        if not _BASE.match(meta.image):
            raise errors.InvalidArgument(f"a template's base {meta.image!r} is not a plain name")
        if meta.name in builtin_templates():
            raise errors.InvalidArgument(f"{meta.name!r} is a built-in template here")
        root = self.paths.image_templates
        dest = root / meta.image
        async with self.templates.lock(meta.name):
            have = oci.read_meta(self.paths, meta.name)
            if have is not None and have.sha256 == export.sha256 and (root / have.image).exists():
                return self.templates.get(meta.name)  # shipped (or built) before: kept
            if dest.exists():  # the same base under another name, or the shared cache's
                found = await asyncio.to_thread(oci.file_sha256, dest)
                if found != export.sha256:
                    raise errors.TemplateCorrupt(
                        f"this node's {meta.image} has digest {found[:12]}, not the "
                        f"template's {export.sha256[:12]}"
                    )
            else:
                await self._pull(export, pull, dest)
            await self.templates.pool.forget(meta.name)  # a new base: new warm snapshots
            self.templates.warm.forget(meta.name)
            shipped = meta.model_copy(update={"sha256": export.sha256, "shipped_from": source_node})
            oci.write_meta(self.paths, shipped)  # the template exists from here on
        return self.templates.get(meta.name)

    async def _pull(self, export: TemplateExport, pull: Pull, dest: Path) -> None:
        root = dest.parent
        root.mkdir(parents=True, exist_ok=True)
        if shutil.disk_usage(root).free < export.bytes:
            raise errors.NoSpace(f"template base {dest.name} needs {export.bytes >> 20} MiB here")
        tmp = root / f".incoming-{dest.name}-{os.urandom(4).hex()}"
        try:
            await pull(tmp)
            size = tmp.stat().st_size
            found = await asyncio.to_thread(oci.file_sha256, tmp)
            if size != export.bytes or found != export.sha256:
                raise errors.TemplateCorrupt(
                    f"the copy of {dest.name} that arrived ({size} bytes, digest "
                    f"{found[:12]}) does not match its template ({export.bytes} bytes, "
                    f"digest {export.sha256[:12]}): refused and deleted"
                )
            tmp.chmod(0o400)
            tmp.rename(dest)
        finally:
            tmp.unlink(missing_ok=True)
