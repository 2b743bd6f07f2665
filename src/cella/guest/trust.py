"""Making a guest trust a CA: its own file, the system bundle, and the variables that point
tools with bundles of their own (Python requests and pip, Node, git) at that bundle."""

from __future__ import annotations

import contextlib
from typing import Protocol

from cella import errors

CA_DIR = "/usr/local/share/ca-certificates"
BUNDLE = "/etc/ssl/certs/ca-certificates.crt"

# Tools that ignore the system store read these; all point at the bundle trust() extends.
CA_ENV = {
    "SSL_CERT_FILE": BUNDLE,
    "REQUESTS_CA_BUNDLE": BUNDLE,
    "PIP_CERT": BUNDLE,
    "NODE_EXTRA_CA_CERTS": BUNDLE,
    "GIT_SSL_CAINFO": BUNDLE,
}


class Files(Protocol):
    async def read_file(self, path: str) -> bytes: ...

    async def write_file(self, path: str, data: bytes, *, parents: bool = False) -> None: ...


async def trust(agent: Files, name: str, pem: bytes) -> None:
    """Adds `pem` to the guest's trust as `CA_DIR/name.crt` and to the system bundle (made if
    the image has none); idempotent."""
    await agent.write_file(f"{CA_DIR}/{name}.crt", pem, parents=True)
    bundle = b""
    with contextlib.suppress(errors.CellaError):
        bundle = await agent.read_file(BUNDLE)
    if pem not in bundle:
        if bundle and not bundle.endswith(b"\n"):
            bundle += b"\n"
        await agent.write_file(BUNDLE, bundle + pem, parents=True)
