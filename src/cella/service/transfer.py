"""Pulling a snapshot's files (or a template's base image) from another node daemon, node to
node over HTTPS (what a node's `POST /v1/snapshots/import` and `POST /v1/templates/import`
do; the `shipping` and `template_shipping` rooms take them in).

Files are streamed to disk as they arrive, as their non-zero pieces only where the source
sends them so (`cella.storage.sparse`: a RAM file's holes and zero pages never travel);
otherwise all-zero pieces are not written, so a RAM file stays about as sparse as it was on
the source. The destination checks every file against the manifest's checksums before it
uses any of them.
"""

from __future__ import annotations

import asyncio
import os
import ssl
from dataclasses import dataclass
from pathlib import Path

import httpx2

from cella import errors
from cella.models.fleet import SnapshotExport, TemplateExport
from cella.storage import sparse

BLOCK = 64 << 10
TIMEOUT = httpx2.Timeout(30.0, read=300.0)
_ZERO = bytes(BLOCK)


@dataclass(frozen=True, slots=True)
class NodeSource:
    url: str
    key: str
    ca_pem: str | None = None  # the source's own certificate, trusted for its https URL

    def _verify(self) -> ssl.SSLContext | bool:
        if not self.ca_pem:
            return True
        try:
            return ssl.create_default_context(cadata=self.ca_pem)  # that one certificate
        except ssl.SSLError as exc:
            raise errors.InvalidArgument(f"source_ca is not a PEM certificate: {exc}") from None

    def _client(self) -> httpx2.AsyncClient:
        return httpx2.AsyncClient(
            base_url=self.url,
            headers={"authorization": f"Bearer {self.key}"},
            timeout=TIMEOUT,
            verify=self._verify(),
        )

    async def export(self, snapshot_id: str, layers: bool = False) -> SnapshotExport:
        """What the source says of a snapshot; `layers`: a layered one as it is (not
        flattened first: its layer and the RAM file under it are pulled)."""
        params = {"layers": "true"} if layers else None
        async with self._client() as client:
            response = await client.get(f"/v1/snapshots/{snapshot_id}/export", params=params)
        _raise_for(response, f"snapshot {snapshot_id}")
        return SnapshotExport.model_validate_json(response.content)

    async def pull(self, snapshot_id: str, name: str, dest: Path) -> int:
        """One of the snapshot's files to `dest`; returns the bytes that travelled."""
        # in a thread, with the blocking client: a few times faster for hundreds of MiB
        # than the event loop's, and the daemon's loop stays free meanwhile
        path = f"/v1/snapshots/{snapshot_id}/files/{name}?extents=true"
        return await asyncio.to_thread(self._pull, path, snapshot_id, dest)

    async def pull_path(self, path: str, what: str, dest: Path) -> int:
        """A file another route of the source serves (as its non-zero pieces if it can)."""
        return await asyncio.to_thread(self._pull, path, what, dest)

    async def template_export(self, name: str) -> TemplateExport:
        async with self._client() as client:
            response = await client.get(f"/v1/templates/{name}/export")
        _raise_for(response, f"template {name}")
        return TemplateExport.model_validate_json(response.content)

    async def pull_template(self, name: str, dest: Path) -> None:
        """A template's base image, to `dest` (checked by the caller against its digest)."""
        await asyncio.to_thread(self._pull, f"/v1/templates/{name}/base", f"template {name}", dest)

    def _pull(self, path: str, what: str, dest: Path) -> int:
        headers = {"authorization": f"Bearer {self.key}"}
        with httpx2.stream(
            "GET", f"{self.url}{path}", headers=headers, timeout=TIMEOUT, verify=self._verify()
        ) as response:
            if response.status_code != 200:
                response.read()
                _raise_for(response, what)
            pieces = response.headers.get("content-type", "").startswith(sparse.MEDIA_TYPE)
            fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                if pieces:  # its non-zero pieces, where they go
                    receiver = sparse.Receiver(fd)
                    for chunk in response.iter_raw():
                        receiver.feed(chunk)
                    receiver.close()
                    sent = receiver.received
                else:  # the whole file (an older node, or a template's base)
                    sent = 0
                    for chunk in response.iter_raw():
                        sent = _write_sparse(fd, chunk, sent)
                    os.ftruncate(fd, sent)
                os.fsync(fd)
            finally:
                os.close(fd)
        return sent


def _write_sparse(fd: int, data: bytes, offset: int) -> int:
    """Writes `data` at `offset`, leaving all-zero pieces unwritten: the file is new, so
    they read as zeros (holes), whatever their alignment."""
    for start in range(0, len(data), BLOCK):
        block = data[start : start + BLOCK]  # bytes compare far faster than a memoryview
        if block != _ZERO[: len(block)]:
            os.pwrite(fd, block, offset + start)
    return offset + len(data)


def _raise_for(response: httpx2.Response, what: str) -> None:
    if response.status_code == 200:
        return
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text[:200]
    if response.status_code == 404:
        raise errors.NotFound(f"the source node has no {what}: {message}")
    raise errors.CellaError(f"the source node answered {response.status_code}: {message}")
