"""Shipping: snapshots moving between the nodes of a fleet.

The sending node says what a snapshot is (`export`: its row, manifest, how its sandbox was
made, what its disk sits on) and hands out its files; the receiving node takes it in
(`take_in`): the snapshots its disk sits on first, every file checked against the manifest
before a ready row of the same id and tenant appears. Nodes move whole RAM files: a layered
snapshot is flattened before it is exported, except a move's (`describe`), which travels as
its layer and the RAM file under it. Files travel as their non-zero pieces.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

from cella import errors
from cella.models import Snapshot, SnapshotState
from cella.models.fleet import SecretBinding, SnapshotExport
from cella.service.registry import Registry
from cella.service.snapshots import Snapshots
from cella.storage import sparse
from cella.storage.snapshots import SnapshotDir, files_of, has_memory
from cella.store import SnapshotRecord

PIECES = sparse.MEDIA_TYPE  # the media type of a file sent as its non-zero pieces


class Shipping:
    def __init__(self, registry: Registry, snapshots: Snapshots) -> None:
        self.registry = registry
        self.store = registry.store
        self.snapshots = snapshots

    @property
    def root(self) -> Path:
        return self.snapshots.root

    async def export(self, snapshot_id: str) -> SnapshotExport:
        """What another node needs to take this snapshot in (any tenant's: nodes ask); a
        layered snapshot is flattened first (nodes move whole RAM files)."""
        self.snapshots.ready(snapshot_id)
        await self.snapshots.flat(snapshot_id)
        return self._export(snapshot_id)

    def describe(self, snapshot_id: str) -> SnapshotExport:
        """What another node needs to take this snapshot in, as it is: a layered one as
        its layer and the RAM file under it (`ram.base`), which the receiver pulls too."""
        return self._export(snapshot_id)

    def _export(self, snapshot_id: str) -> SnapshotExport:
        row = self.snapshots.ready(snapshot_id)
        snap = self.snapshots.directory(snapshot_id)
        spec, secrets = self.snapshots.source_of(row)
        backing = snap.disk_backing()
        parent = Path(backing).parent if backing else None
        on_snapshot = parent is not None and parent.parent == self.root.resolve()
        return SnapshotExport(
            snapshot=Snapshot.model_validate(row),
            tenant=row.tenant,
            manifest=snap.manifest(),
            source=spec,
            secrets={
                k: SecretBinding(secret=v.secret, placeholder=v.placeholder)
                for k, v in secrets.items()
            },
            backing_snapshot_id=parent.name if on_snapshot and parent else None,
            backing_path=None if on_snapshot else backing,
        )

    def pieces(self, snapshot_id: str, name: str) -> Iterator[bytes]:
        """One of a ready snapshot's files as its non-zero pieces (`PIECES`), to send."""
        return sparse.encode(self.file(snapshot_id, name))

    def file(self, snapshot_id: str, name: str) -> Path:
        """One of a ready snapshot's files, to send to another node."""
        self.snapshots.ready(snapshot_id)
        snap = self.snapshots.directory(snapshot_id)
        if name not in (*snap.files(), "manifest.json"):
            raise errors.NotFound(f"a snapshot has no file {name!r}")
        return snap.path / name

    async def take_in(
        self,
        export: SnapshotExport,
        fetch: Callable[[str], Awaitable[SnapshotExport]],
        pull: Callable[[str, str, Path], Awaitable[object]],
    ) -> SnapshotRecord:
        """Another node's snapshot made local: the snapshots its disk sits on first
        (`fetch` gets their exports), its files pulled (`pull(snapshot id, file name,
        destination)`) and checked against its manifest, then a ready row of the same id and
        tenant. A snapshot already here is kept as it is: taken in once, then cached. A
        layered one stays layered (its `ram.base` pulled like its other files)."""
        meta = export.snapshot
        async with self.registry.lock(meta.id):
            have = self.store.get_snapshot(meta.id)
            if have is not None and have.state == SnapshotState.ready:
                return have
            base: Path | None = None
            if export.backing_snapshot_id:
                parent = await self.take_in(await fetch(export.backing_snapshot_id), fetch, pull)
                base = self.snapshots.directory(parent.id).disk
            elif export.backing_path and not Path(export.backing_path).exists():
                raise errors.ImageMissing(
                    f"snapshot {meta.id} sits on {export.backing_path}, which this node lacks "
                    f"(build template {meta.template!r} here)"
                )
            for image in ("kernel", "initrd"):
                if not Path(str(export.manifest.get(image))).exists():
                    raise errors.ImageMissing(f"this node lacks the {image} of snapshot {meta.id}")
            need = sum(int(n) for n in export.manifest.get("bytes", {}).values())
            self.root.mkdir(parents=True, exist_ok=True)
            if shutil.disk_usage(self.root).free < need:
                raise errors.NoSpace(f"snapshot {meta.id} needs {need >> 20} MiB here")
            tmp = self.root / f".incoming-{meta.id}-{os.urandom(4).hex()}"
            tmp.mkdir()
            try:
                for name in files_of(export.manifest):
                    await pull(meta.id, name, tmp / name)
                incoming = SnapshotDir(tmp)
                incoming.manifest_path.write_text(json.dumps(export.manifest, sort_keys=True))
                await asyncio.to_thread(incoming.verify)
                if base is not None:
                    incoming.rebase_disk(base)
                incoming.source_path.write_text(
                    json.dumps(
                        {
                            "spec": export.source.model_dump(mode="json", exclude_unset=True),
                            "secrets": {k: v.model_dump() for k, v in export.secrets.items()},
                        }
                    )
                )
                for name in files_of(export.manifest):
                    (tmp / name).chmod(0o400)
                shutil.rmtree(self.root / meta.id, ignore_errors=True)
                tmp.rename(self.root / meta.id)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            fields = {
                "state": SnapshotState.ready,
                "name": meta.name,
                "size_bytes": meta.size_bytes,
                "paused_ms": meta.paused_ms,
                "error": None,
            }
            if have is not None:  # deleted or failed here before: the same id again
                self.store.update_snapshot(meta.id, **fields)
                return self.snapshots.get(export.tenant, meta.id)
            return self.store.insert_snapshot(
                SnapshotRecord(
                    id=meta.id,
                    tenant=export.tenant,
                    sandbox_id=meta.sandbox_id,
                    parent_snapshot_id=meta.parent_snapshot_id,
                    template=meta.template,
                    vcpus=meta.vcpus,
                    memory_mib=meta.memory_mib,
                    memory=has_memory(export.manifest),
                    **fields,  # type: ignore[arg-type]
                )
            )
