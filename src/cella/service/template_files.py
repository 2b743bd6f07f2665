"""The files of templates built from steps (E2B's `Template.copy`): uploaded by hash, one
directory per tenant, kept while a build may still need them.

A file is needed while a build that is running or ready names it in its steps (a later
build on that template repeats them, so they must still be here) and for `keep_seconds`
after it was uploaded or last asked for (a client asks whether a hash is present before it
starts a build that names it). Anything else is removed by `sweep` (hourly, and before an
upload is refused for room). A tenant's files together are held to `quota_bytes`: an upload
past it is refused with 413, and nothing already kept is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import AsyncIterable
from pathlib import Path

from cella import errors
from cella.images import steps as translate
from cella.service.periodic import Periodic
from cella.store import Store

log = logging.getLogger("cella.template_files")
NEEDED_STATES = ("building", "ready")  # a waiting build has no steps yet
SWEEP_SECONDS = 3600.0


class TemplateFiles:
    def __init__(
        self,
        store: Store,
        root: Path,
        *,
        max_upload_bytes: int,
        quota_bytes: int,
        keep_seconds: float,
    ) -> None:
        self.store = store
        self.root = root
        self.max_upload_bytes = max_upload_bytes
        self.quota_bytes = quota_bytes
        self.keep_seconds = keep_seconds
        self._loop = Periodic(
            "cella-template-files",
            self._sweep_pass,
            lambda: min(SWEEP_SECONDS, max(self.keep_seconds / 4, 1.0)),
            log,
            at_once=True,
        )

    def path(self, tenant: str, files_hash: str) -> Path:
        translate.check_hash(files_hash)
        return self._dir(tenant) / files_hash

    def _dir(self, tenant: str) -> Path:
        return self.root / hashlib.sha256(tenant.encode()).hexdigest()[:32]

    def present(self, tenant: str, files_hash: str) -> bool:
        """Whether the files are here; asking keeps them for `keep_seconds` more (the build
        that names them is about to start)."""
        path = self.path(tenant, files_hash)
        try:
            os.utime(path)
        except FileNotFoundError:
            return False
        return True

    def used_bytes(self, tenant: str) -> int:
        """What the tenant's files (uploads under way included) take."""
        total = 0
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self._dir(tenant)):
                with contextlib.suppress(FileNotFoundError):
                    total += entry.stat().st_size
        return total

    async def receive(self, tenant: str, files_hash: str, body: AsyncIterable[bytes]) -> None:
        """Keeps an upload (a tar archive, maybe gzipped: unpacked only in a builder
        sandbox) whole or not at all; 413 past the upload limit or the tenant's quota."""
        dest = self.path(tenant, files_hash)
        dest.parent.mkdir(parents=True, exist_ok=True)
        room = self.quota_bytes - self.used_bytes(tenant)
        swept = False
        partial = dest.with_name(f".{dest.name}.{os.getpid()}.{time.monotonic_ns()}")
        size = 0
        try:
            with open(partial, "wb") as out:
                async for chunk in body:
                    size += len(chunk)
                    if size > self.max_upload_bytes:
                        raise errors.PayloadTooLarge(
                            f"the files are over {self.max_upload_bytes >> 20} MiB"
                        )
                    if size > room and not swept:  # what no build needs goes first
                        swept = True
                        await asyncio.to_thread(self.sweep, tenant)
                        room = self.quota_bytes - self.used_bytes(tenant) + size - len(chunk)
                    if size > room:
                        raise errors.PayloadTooLarge(
                            f"the tenant's template files would be over their quota of "
                            f"{self.quota_bytes >> 20} MiB (files no build uses are removed "
                            f"{self.keep_seconds / 3600:g} h after their upload)"
                        )
                    await asyncio.to_thread(out.write, chunk)
            partial.rename(dest)
        finally:
            partial.unlink(missing_ok=True)

    def needed(self) -> set[tuple[str, str]]:
        """(tenant directory, hash) of every file a running or ready build names."""
        out = set()
        for build in self.store.builds_in(NEEDED_STATES):
            steps = json.loads(build.spec).get("steps") or []
            for step in steps:
                if isinstance(step, dict) and isinstance(step.get("files_hash"), str):
                    out.add((self._dir(build.tenant).name, step["files_hash"]))
        return out

    def sweep(self, tenant: str | None = None, now: float | None = None) -> int:
        """Removes the files (of `tenant`, or all) no build needs that were uploaded or asked
        for more than `keep_seconds` ago, and uploads abandoned as long; returns how many."""
        cutoff = (time.time() if now is None else now) - self.keep_seconds
        needed = self.needed()
        dirs = [self._dir(tenant)] if tenant is not None else self._all_dirs()
        removed = 0
        for directory in dirs:
            with contextlib.suppress(FileNotFoundError):
                for entry in os.scandir(directory):
                    with contextlib.suppress(FileNotFoundError):
                        if (directory.name, entry.name) in needed:
                            continue
                        if entry.stat().st_mtime < cutoff:
                            os.unlink(entry.path)
                            removed += 1
        if removed:
            log.info("template files: removed %d no build needs", removed)
        return removed

    def _all_dirs(self) -> list[Path]:
        if not self.root.exists():
            return []
        return [p for p in self.root.iterdir() if p.is_dir()]

    def start(self) -> None:
        self._loop.start()

    async def close(self) -> None:
        await self._loop.close()

    async def _sweep_pass(self) -> None:
        await asyncio.to_thread(self.sweep)
