"""Files in a sandbox: content streamed both ways, listings, metadata, tar archives.

Owns the upload limit (a body over it is refused before anything is half-written) and the
trace of every change: `file_write` (path, size, mode, SHA-256), `mkdir`, `chmod`,
`file_remove` and `archive_upload`. Paths arrive validated (`cella.models.GuestPath`).
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterable, AsyncIterator

from cella import errors
from cella.guest.protocol import Entry
from cella.runtime.contract import GuestAgent
from cella.service.registry import Registry


class Files:
    def __init__(self, registry: Registry, max_upload_bytes: int) -> None:
        self.registry = registry
        self.events = registry.events
        self.max_upload_bytes = max_upload_bytes

    def _agent(self, tenant: str, sandbox_id: str) -> GuestAgent:
        return self.registry.live(tenant, sandbox_id)[1].agent

    async def read(self, tenant: str, sandbox_id: str, path: str) -> AsyncIterator[bytes]:
        """The file's content, streamed; its first chunk is read before this returns, so a
        missing file is an error here rather than a cut stream."""
        return await _primed(self._agent(tenant, sandbox_id).read_stream(path))

    async def write(
        self,
        tenant: str,
        sandbox_id: str,
        path: str,
        body: AsyncIterable[bytes],
        *,
        mode: int = 0o644,
        parents: bool = False,
        declared: int | None = None,
    ) -> Entry:
        """Replaces the file atomically with `body` (at most the upload limit)."""
        agent = self._agent(tenant, sandbox_id)
        digest = hashlib.sha256()
        await agent.write_file(
            path, _hashed(self._bounded(body, declared), digest), mode=mode, parents=parents
        )
        entry = await agent.stat(path)
        self.events.emit(
            sandbox_id,
            "file_write",
            {"path": path, "size": entry.size, "mode": mode, "sha256": digest.hexdigest()},
        )
        return entry

    async def list(self, tenant: str, sandbox_id: str, path: str) -> list[Entry]:
        return await self._agent(tenant, sandbox_id).list_dir(path)

    async def stat(self, tenant: str, sandbox_id: str, path: str) -> Entry:
        return await self._agent(tenant, sandbox_id).stat(path)

    async def mkdir(
        self, tenant: str, sandbox_id: str, path: str, *, mode: int, parents: bool
    ) -> None:
        await self._agent(tenant, sandbox_id).mkdir(path, mode=mode, parents=parents)
        self.events.emit(sandbox_id, "mkdir", {"path": path, "mode": mode})

    async def chmod(self, tenant: str, sandbox_id: str, path: str, mode: int) -> None:
        await self._agent(tenant, sandbox_id).chmod(path, mode)
        self.events.emit(sandbox_id, "chmod", {"path": path, "mode": mode})

    async def remove(self, tenant: str, sandbox_id: str, path: str, *, recursive: bool) -> None:
        await self._agent(tenant, sandbox_id).remove(path, recursive=recursive)
        self.events.emit(sandbox_id, "file_remove", {"path": path, "recursive": recursive})

    async def download_archive(
        self, tenant: str, sandbox_id: str, path: str
    ) -> AsyncIterator[bytes]:
        """The directory as an uncompressed tar archive, streamed (primed like `read`)."""
        return await _primed(self._agent(tenant, sandbox_id).tar_out(path))

    async def upload_archive(
        self,
        tenant: str,
        sandbox_id: str,
        path: str,
        body: AsyncIterable[bytes],
        declared: int | None = None,
    ) -> None:
        """Unpacks a tar archive into the directory (created if missing)."""
        agent = self._agent(tenant, sandbox_id)
        digest = hashlib.sha256()
        size = 0

        async def counted() -> AsyncIterator[bytes]:
            nonlocal size
            async for chunk in _hashed(self._bounded(body, declared), digest):
                size += len(chunk)
                yield chunk

        await agent.tar_in(path, counted())
        self.events.emit(
            sandbox_id, "archive_upload", {"path": path, "size": size, "sha256": digest.hexdigest()}
        )

    async def _bounded(
        self, body: AsyncIterable[bytes], declared: int | None
    ) -> AsyncIterator[bytes]:
        limit = self.max_upload_bytes
        if declared is not None and declared > limit:
            raise errors.PayloadTooLarge(f"upload of {declared} bytes exceeds {limit}")
        seen = 0
        async for chunk in body:
            seen += len(chunk)
            if seen > limit:
                raise errors.PayloadTooLarge(f"upload exceeds {limit} bytes")
            yield chunk


async def _hashed(stream: AsyncIterable[bytes], digest: hashlib._Hash) -> AsyncIterator[bytes]:
    async for chunk in stream:
        digest.update(chunk)
        yield chunk


async def _primed(stream: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    first = await anext(stream, b"")

    async def rest() -> AsyncIterator[bytes]:
        if first:
            yield first
        async for chunk in stream:
            yield chunk

    return rest()
