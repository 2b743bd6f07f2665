"""Images a tenant names are pulled inside a microVM, never by the host.

A registry a tenant names is the tenant's to choose, and so is what it answers: its address
(a name that resolves to the host's loopback, a cloud metadata service, a private network),
its redirects and token realms, its manifests and error texts. The host's own tools would
meet all of that outside the egress boundary. So the pull runs where the tenant's code runs:
`buildah` in a builder sandbox of the tenant, whose connections leave through the egress
proxy under the operator's boundary like any sandbox's. The image comes out as an OCI layout
the host copies blob by blob, each checked against its digest (`oci.copy_layout`).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import urlsplit

from cella import errors
from cella.images import oci
from cella.models import NetworkPolicy, SandboxCreate
from cella.policy.access import Principal
from cella.service.image_registries import image_host
from cella.service.templates import BUILDAH, BUILDER_TEMPLATE, Progress, Templates

PULL_DIR = "/var/tmp/cella-pull"
AUTH_FILE = f"{PULL_DIR}/auth.json"  # a file, not an argument: arguments are traced
LAYOUT_TAG = "pulled"


class ImagePulls:
    def __init__(self, templates: Templates) -> None:
        self.templates = templates

    def check(self, tenant: str, image: str) -> None:
        """Refuses now an image whose registry is an address outside the boundary (a name
        is checked where it is resolved, by the proxy, at connect)."""
        host = urlsplit("//" + image_host(image)).hostname
        if not host:
            raise errors.InvalidArgument(f"{image!r} names no registry")
        try:
            self.templates.lifecycle.egress.check_policy(
                Principal.service(tenant), NetworkPolicy(allow=[host])
            )
        except errors.DestinationForbidden as exc:
            raise errors.DestinationForbidden(
                f"the registry of {image!r} is outside the egress boundary: {exc.message}"
            ) from None

    async def pull(
        self,
        tenant: str,
        image: str,
        credentials: str | None,
        dest: Path,
        limits: oci.ImportLimits,
        progress: Progress,
        labels: dict[str, str],
    ) -> str:
        """Pulls the registry image `image` (`host/repo:tag`) in a builder sandbox of
        `tenant` and copies it into the new layout `dest`; returns the reference skopeo
        reads it by. A refused or failed pull fails with the builder's own words."""
        self.check(tenant, image)
        try:
            self.templates.registry.driver.template_disk_mib(BUILDER_TEMPLATE)
        except errors.ImageMissing:
            raise errors.ImageMissing(
                "images are pulled in a sandbox of the docker template, which is not built: "
                "run `cella setup --template docker`"
            ) from None
        spec = SandboxCreate(  # every public host: registries redirect to CDNs and realms
            template=BUILDER_TEMPLATE,
            ttl_seconds=3600,
            labels={"cella.role": "image-puller", **labels},
            network=NetworkPolicy(allow=["*"]),
        )
        progress(f"starting a builder sandbox to pull {image}")
        who = Principal.service(tenant)  # the tenant's, as the snapshot is
        box = await self.templates.lifecycle.create(who, spec)
        try:
            await self.templates.files.mkdir(who, box.id, PULL_DIR, mode=0o700, parents=True)
            pull = [*BUILDAH, "pull", "--quiet"]
            if credentials is not None:
                await self.templates.files.write(
                    who,
                    box.id,
                    AUTH_FILE,
                    _once(oci.auth_json(image_host(image), credentials).encode()),
                    mode=0o600,
                    parents=True,
                )
                pull += ["--authfile", AUTH_FILE]
            progress(f"pulling {image}")
            await self.templates.run_step(
                who, box.id, [*pull, f"docker://{image}"], progress, "pull"
            )
            with contextlib.suppress(errors.CellaError):
                await self.templates.files.remove(who, box.id, AUTH_FILE, recursive=False)
            await self.templates.run_step(
                who,
                box.id,
                [*BUILDAH, "push", "--quiet", image,
                 f"oci:{PULL_DIR}/layout:{LAYOUT_TAG}"],
                progress,
                "export",
            )  # fmt: skip

            async def read(path: str) -> AsyncIterator[bytes]:
                return await self.templates.files.read(who, box.id, path)

            progress("copying the image out of the builder")
            return await oci.copy_layout(read, f"{PULL_DIR}/layout", dest, limits)
        finally:
            with contextlib.suppress(errors.CellaError):
                await self.templates.lifecycle.delete(who, box.id)


async def _once(data: bytes) -> AsyncIterator[bytes]:
    yield data
