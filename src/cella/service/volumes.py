"""Volumes: a tenant's persistent file trees, which outlive sandboxes and are shared between
them.

The daemon keeps each volume as a directory on the host (`storage/volumes.py`) and is the
only writer of it. Callers reach a volume's files through the content API (read, write,
list, remove: no sandbox needed); a sandbox mounts it as a network file system: rclone in
the guest (`service/buckets.py` mounts it beside buckets) speaks WebDAV to `volumes.cella`,
and the egress proxy sends those requests to the daemon (`server/routes/volume_dav.py`) with
the sandbox's mount token, so the guest holds no credential and reaches only the volumes
its create named, a read-only mount without writes (refused here, not only by a flag in
the guest). Nothing of a volume is copied into a snapshot: a sandbox forked or restored
from one mounts the same volume again.

A tenant's volumes hold at most `max_volume_mib_per_tenant` between them: a write that
would pass it is refused while it streams (`VolumeQuotaExceeded`), and what was there stays.
A volume that a sandbox (not deleted) mounts is deleted only with `force`; its deletion
removes its files.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterable, AsyncIterator
from datetime import UTC, datetime
from typing import Any

from cella import errors
from cella.config import DaemonSettings
from cella.models import SandboxCreate, SandboxState, Volume, VolumeList
from cella.models.volumes import VolumeEntry, VolumeMount
from cella.policy.access import Principal
from cella.service.ports import Ports
from cella.service.registry import Registry
from cella.service.remote_volumes import RemoteVolume, RemoteVolumes
from cella.storage.volumes import Entry, VolumeFiles
from cella.store import SandboxRecord, VolumeRecord

__all__ = ["Entry", "RemoteVolume", "VolumeRecord", "Volumes", "entry_of"]

GONE = frozenset({SandboxState.deleting, SandboxState.deleted, SandboxState.error})
WRITES = frozenset({"PUT", "DELETE", "MKCOL", "MOVE", "COPY", "PROPPATCH", "POST", "PATCH"})


def entry_of(entry: Entry) -> VolumeEntry:
    def at(t: float) -> datetime:
        return datetime.fromtimestamp(t, UTC)

    return VolumeEntry(
        name=entry.name,
        path=entry.path,
        type="directory" if entry.is_dir else "file",
        size=entry.size,
        mode=entry.mode,
        mtime=at(entry.mtime),
        ctime=at(entry.ctime),
        atime=at(entry.atime),
    )


class Volumes:
    def __init__(
        self, settings: DaemonSettings, registry: Registry, ports: Ports, *, clear: bool
    ) -> None:
        self.registry = registry
        self.store = registry.store
        self.ports = ports
        self.files = VolumeFiles(settings.data_dir / "volumes")
        self.remote = RemoteVolumes(settings.data_dir / "remote-volumes.json")  # a fleet's
        quota = settings.max_volume_mib_per_tenant
        self.quota = None if quota is None else quota << 20
        self.clear = clear  # the egress proxy reaches the daemon in clear (mounts need it)

    # -- the volumes ----------------------------------------------------------------------

    def create(self, who: Principal, name: str) -> Volume:
        record = VolumeRecord(id=f"vol-{secrets.token_hex(8)}", tenant=who.tenant, name=name)
        self.files.create(record.id)
        try:
            self.store.put_volume(record)
        except errors.CellaError:
            self.files.destroy(record.id)
            raise
        return self.shown(record)

    def record(self, who: Principal, key: str) -> VolumeRecord:
        found = self.store.get_volume(who.tenant, key)
        if found is None:
            raise errors.NotFound(f"volume {key} not found")
        return found

    def get(self, who: Principal, key: str) -> Volume:
        return self.shown(self.record(who, key))

    def find(self, who: Principal) -> VolumeList:
        records = self.store.list_volumes(who.tenant)
        return VolumeList(
            volumes=[self.shown(r) for r in records],
            quota_bytes=self.quota,
            used_bytes=self.files.size_of(r.id for r in records),
        )

    def names(self, who: Principal) -> dict[str, str]:
        """The tenant's volumes' names by id."""
        return {r.id: r.name for r in self.store.list_volumes(who.tenant)}

    def shown(self, record: VolumeRecord) -> Volume:
        return Volume(
            id=record.id,
            name=record.name,
            created_at=datetime.fromisoformat(record.created_at),
            size_bytes=self.files.size_of([record.id]),
            used_by=[r.id for r in self.users(record)],
        )

    def users(self, record: VolumeRecord) -> list[SandboxRecord]:
        """The sandboxes (not deleted) that mount the volume."""
        rows = self.registry.find(None)
        return [
            r
            for r in rows
            if r.tenant == record.tenant
            and r.state != SandboxState.deleted
            and any(m.volume == record.id for m in r.volume_mounts)
        ]

    def delete(self, who: Principal, key: str, force: bool = False) -> None:
        """The volume and its files; one a sandbox mounts only with `force` (that sandbox's
        mount then answers as a volume that is gone)."""
        record = self.record(who, key)
        users = self.users(record)
        if users and not force:
            raise errors.InUse(
                f"volume {record.name} is mounted by sandbox {users[0].id}"
                + (f" and {len(users) - 1} more" if len(users) > 1 else "")
                + ": delete them first, or delete it with force"
            )
        self.store.delete_volume(record.tenant, record.id)
        self.files.destroy(record.id)

    def token(self, who: Principal, key: str) -> str:
        return self.ports.volume_token(self.record(who, key).id)

    def by_token(self, volume_id: str, token: str) -> tuple[Principal, VolumeRecord]:
        """The volume a content-API token opens (E2B's bearer), as its tenant's service."""
        record = self.store.volume_by_id(volume_id)
        if record is not None and self.ports.same(token, self.ports.volume_token(volume_id)):
            return Principal.service(record.tenant), record
        raise errors.Unauthenticated("the volume token is not valid for this volume")

    # -- a create's mounts ------------------------------------------------------------------

    def settle(self, who: Principal, spec: SandboxCreate) -> SandboxCreate:
        """The create with each volume mount naming its volume by id; `InvalidArgument`
        naming one the tenant does not have."""
        if not spec.volume_mounts:
            return spec
        if not self.clear:
            raise errors.InvalidArgument(
                "volume_mounts: not supported by a daemon serving TLS without a "
                "proxy_api_port (the egress proxy reaches the daemon in clear on loopback)"
            )
        settled = []
        for mount in spec.volume_mounts:
            found = self.store.get_volume(who.tenant, mount.volume) or self.remote.find(
                who.tenant, mount.volume
            )  # one of this node's, or one lent by a fleet gateway
            if found is None:
                raise errors.InvalidArgument(f"volume_mounts: no volume {mount.volume!r}")
            settled.append(mount.model_copy(update={"volume": found.id}))
        return spec.model_copy(update={"volume_mounts": settled})

    def reachable(self, tenant: str, mounts: Any) -> None:
        """A sandbox arriving from another node (a move) mounts these volumes (its row's
        `volume_mounts`, as stored: JSON): each must be this node's or lent to it by the
        fleet's gateway, else `InvalidState` naming it (it then stays where it was)."""
        for mount in json.loads(mounts) if isinstance(mounts, str) else mounts or []:
            volume_id = VolumeMount.model_validate(mount).volume
            lent = self.remote.find(tenant, volume_id)
            if self.store.get_volume(tenant, volume_id) is None and (
                lent is None or lent.id != volume_id
            ):
                raise errors.InvalidState(
                    f"volume {volume_id} is neither on this node nor lent to it: a sandbox "
                    "mounting it cannot move here"
                )

    def mount_of(
        self, sandbox_id: str, token: str, volume_id: str, method: str
    ) -> VolumeRecord | RemoteVolume:
        """A mounted volume a sandbox's request (through the egress proxy) may reach: the
        proxy's token for the sandbox, a mount of the volume, and no write to a read-only
        one; a volume of another node (lent by a fleet gateway) is sent on there."""
        self.ports.check_mount_token(sandbox_id, token)
        row = self.registry.row(sandbox_id)
        if row.state in GONE:  # revoked with the sandbox: its token opens nothing more
            raise errors.PermissionDenied(f"sandbox {sandbox_id} is {row.state}")
        mount = next((m for m in row.volume_mounts if m.volume == volume_id), None)
        record: VolumeRecord | RemoteVolume | None = self.store.get_volume(row.tenant, volume_id)
        if record is None:
            remote = self.remote.find(row.tenant, volume_id)
            record = remote if remote is not None and remote.id == volume_id else None
        if mount is None or record is None:
            raise errors.NotFound(f"sandbox {sandbox_id} mounts no volume {volume_id}")
        if mount.read_only and method.upper() in WRITES:
            raise errors.PermissionDenied(f"volume {record.name} is mounted read-only")
        return record

    # -- content ----------------------------------------------------------------------------

    def stat(self, record: VolumeRecord, path: str) -> Entry:
        return self.files.stat(record.id, path)

    def listing(self, record: VolumeRecord, path: str, depth: int = 1) -> list[Entry]:
        return self.files.listing(record.id, path, depth)

    async def read(
        self, record: VolumeRecord, path: str, start: int = 0, end: int | None = None
    ) -> AsyncIterator[bytes]:
        return await self.files.read(record.id, path, start, end)

    async def write(
        self,
        record: VolumeRecord,
        path: str,
        chunks: AsyncIterable[bytes],
        parents: bool = False,
        mode: int | None = None,
    ) -> Entry:
        """The file at `path`, replaced whole; refused past the tenant's quota."""
        room = None
        if self.quota is not None:
            ids = [r.id for r in self.store.list_volumes(record.tenant)]
            room = max(self.quota - self.files.size_of(ids), 0)
        entry, _ = await self.files.write(record.id, path, chunks, room, parents)
        if mode is not None:
            entry = self.files.chmod(record.id, path, mode)
        return entry

    def mkdir(
        self, record: VolumeRecord, path: str, parents: bool = False, mode: int | None = None
    ) -> Entry:
        entry = self.files.mkdir(record.id, path, parents)
        return entry if mode is None else self.files.chmod(record.id, path, mode)

    def remove(self, record: VolumeRecord, path: str) -> None:
        self.files.remove(record.id, path)

    def move(self, record: VolumeRecord, src: str, dst: str, overwrite: bool = True) -> bool:
        return self.files.move(record.id, src, dst, overwrite)

    def chmod(self, record: VolumeRecord, path: str, mode: int) -> Entry:
        return self.files.chmod(record.id, path, mode)
