"""Pulling a snapshot's files from another node daemon, node to node over HTTP.

Files are streamed to disk as they arrive; all-zero blocks are not written, so a RAM file
stays as sparse as it was on the source. The destination checks every file against the
manifest's checksums before it uses any of them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import httpx2

from cella import errors
from cella.models.fleet import SnapshotExport

BLOCK = 64 << 10
_ZERO = bytes(BLOCK)


@dataclass(frozen=True, slots=True)
class NodeSource:
    url: str
    key: str

    def _client(self) -> httpx2.AsyncClient:
        return httpx2.AsyncClient(
            base_url=self.url,
            headers={"authorization": f"Bearer {self.key}"},
            timeout=httpx2.Timeout(30.0, read=300.0),
        )

    async def export(self, snapshot_id: str) -> SnapshotExport:
        async with self._client() as client:
            response = await client.get(f"/v1/snapshots/{snapshot_id}/export")
        _raise_for(response, snapshot_id)
        return SnapshotExport.model_validate_json(response.content)

    async def pull(self, snapshot_id: str, name: str, dest: Path) -> None:
        async with self._client() as client:
            url = f"/v1/snapshots/{snapshot_id}/files/{name}"
            async with client.stream("GET", url) as response:
                if response.status_code != 200:
                    await response.aread()
                    _raise_for(response, snapshot_id)
                fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    offset, pending = 0, b""
                    async for chunk in response.aiter_bytes():
                        pending += chunk
                        usable = len(pending) - len(pending) % BLOCK
                        offset = _write_sparse(fd, pending[:usable], offset)
                        pending = pending[usable:]
                    offset = _write_sparse(fd, pending, offset)
                    os.ftruncate(fd, offset)
                    os.fsync(fd)
                finally:
                    os.close(fd)


def _write_sparse(fd: int, data: bytes, offset: int) -> int:
    view = memoryview(data)
    for start in range(0, len(data), BLOCK):
        block = view[start : start + BLOCK]
        if block != _ZERO[: len(block)]:
            os.pwrite(fd, block, offset + start)
    return offset + len(data)


def _raise_for(response: httpx2.Response, snapshot_id: str) -> None:
    if response.status_code == 200:
        return
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text[:200]
    if response.status_code == 404:
        raise errors.NotFound(f"the source node has no snapshot {snapshot_id}: {message}")
    raise errors.CellaError(f"the source node answered {response.status_code}: {message}")
