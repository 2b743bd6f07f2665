"""A move's pre-copy: what a running sandbox's move sends while its guest still runs, so that
the freeze ships only what it wrote since.

On the source (`start`, under the sandbox's lock, held until the move's export hands it on,
or `abort`):
- its disk is split (`Driver.split_disk`): the overlay it wrote so far stops changing and is
  copied as a snapshot without memory (the pre-copy snapshot), while the guest writes a
  new, empty overlay on it;
- the RAM file its memory sits on (a restored VM maps its snapshot's RAM file privately and
  holds only the pages it wrote as its own) is offered by its digest.
On the destination (`take`), while the guest runs on: the pre-copy snapshot is taken in as
any shipped snapshot (checked against its manifest) and the RAM file is pulled as its
non-zero pieces into a staging directory (checked against its digest).

At the freeze (`Moves.export`) the move's snapshot holds the device state, the pages the
guest wrote (a RAM layer over that RAM file) and the new overlay, whose disk is made to sit
on the pre-copy snapshot's (`freeze`); the destination's take-in finds that snapshot and the
staged RAM file already there (`pull`) and pulls the rest. `abort` on the source merges the
overlay back into the disk below and drops the pre-copy snapshot; `drop` on the destination
removes what it staged for a move that did not happen.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from cella import errors
from cella.models import SandboxState
from cella.models.fleet import PrecopyOffer, PrecopyTake, PrecopyTaken, SnapshotExport
from cella.service.registry import Registry
from cella.service.shipping import Shipping
from cella.service.snapshots import Snapshots
from cella.service.transfer import NodeSource
from cella.storage import sparse
from cella.storage.snapshots import sha256_of
from cella.store import SandboxRecord, SnapshotRecord

S = SandboxState
Pull = Callable[[str, str, Path], Awaitable[object]]


def precopy_name(sandbox_id: str) -> str:
    return f"move of {sandbox_id}: its disk before"


@dataclass
class Ahead:
    """A pre-copy in place on this node (the move's source)."""

    lock: asyncio.Lock | None  # the sandbox's, held until the export takes it over
    split: bool = False
    snapshot_id: str | None = None
    ram: Path | None = None
    ram_sha256: str | None = None


@dataclass
class Staged:
    """What this node (the move's destination) took in ahead of a sandbox's freeze."""

    snapshot_id: str | None = None
    ram_sha256: str | None = None
    directory: Path | None = None
    # snapshot id -> the digest of the RAM file under its layer, as its export says
    digests: dict[str, str] = field(default_factory=dict)


class Precopies:
    def __init__(self, registry: Registry, snapshots: Snapshots, shipping: Shipping) -> None:
        self.registry = registry
        self.store = registry.store
        self.driver = registry.driver
        self.snapshots = snapshots
        self.shipping = shipping
        self._ahead: dict[str, Ahead] = {}  # source: sandbox id -> its pre-copy
        self._staged: dict[str, Staged] = {}  # destination: sandbox id -> what it took

    # -- the source ----------------------------------------------------------------------

    async def start(self, sandbox_id: str) -> PrecopyOffer:
        """Splits a running sandbox's disk and offers what it wrote so far and the RAM
        file under its memory; the sandbox runs on (see the module's doc). A sandbox that
        is not running has nothing to pre-copy: the offer is empty."""
        row = self._row(sandbox_id)
        if sandbox_id in self._ahead:
            raise errors.InvalidState(f"sandbox {sandbox_id} is being moved already")
        if row.state != S.running or row.volume_mounts:
            return PrecopyOffer(sandbox_id=sandbox_id)
        started = time.monotonic()
        lock = self.registry.lock(sandbox_id)
        await lock.acquire()
        ahead = self._ahead[sandbox_id] = Ahead(lock=lock)
        try:
            vm = self.registry.vm(sandbox_id)
            row = self._row(sandbox_id)
            if vm is None or row.state != S.running:
                raise errors.InvalidState(f"sandbox {sandbox_id} became {row.state}")
            await self.driver.split_disk(vm)
            ahead.split = True
            ahead.snapshot_id = (await self._disk_so_far(row)).id
            ram = self.driver.memory_base(vm)
            if ram is not None:
                ahead.ram, ahead.ram_sha256 = ram, await asyncio.to_thread(sha256_of, ram)
        except BaseException:
            await self.abort(sandbox_id)
            raise
        return PrecopyOffer(
            sandbox_id=sandbox_id,
            snapshot_id=ahead.snapshot_id,
            ram_sha256=ahead.ram_sha256,
            split_ms=round((time.monotonic() - started) * 1000, 1),
        )

    async def _disk_so_far(self, row: SandboxRecord) -> SnapshotRecord:
        """The split disk's lower file, which no longer changes, as a snapshot without
        memory (its lock held by the caller)."""
        record = self.snapshots.creating_disk(row, precopy_name(row.id))
        return await self.snapshots.copy_disk(row, record)

    def ram_pieces(self, sandbox_id: str) -> Iterator[bytes]:
        """The RAM file a pre-copy offered, as its non-zero pieces (`shipping.PIECES`)."""
        ahead = self._ahead.get(sandbox_id)
        if ahead is None or ahead.ram is None:
            raise errors.NotFound(f"no pre-copy of sandbox {sandbox_id}'s memory here")
        return sparse.encode(ahead.ram)

    def holds(self, sandbox_id: str) -> asyncio.Lock | None:
        """The sandbox's lock, if its pre-copy holds it (the move's export takes it over
        once it succeeds: `hand_over`)."""
        ahead = self._ahead.get(sandbox_id)
        return None if ahead is None else ahead.lock

    def hand_over(self, sandbox_id: str) -> None:
        """The move's export holds the lock now (and releases it when the move ends)."""
        if (ahead := self._ahead.get(sandbox_id)) is not None:
            ahead.lock = None

    async def freeze(self, sandbox_id: str, snap: SnapshotRecord) -> None:
        """The move's snapshot, taken at the freeze over the split disk: its disk (the
        overlay written since the split) made to sit on the pre-copy snapshot's disk, which
        holds what the file below held, and that snapshot named its parent."""
        ahead = self._ahead.get(sandbox_id)
        if ahead is None or ahead.snapshot_id is None:
            return
        below = self.snapshots.directory(ahead.snapshot_id).disk
        await asyncio.to_thread(self.snapshots.directory(snap.id).rebase_disk, below)
        size = sum(self.snapshots.directory(snap.id).manifest()["bytes"].values())
        self.store.update_snapshot(snap.id, parent_snapshot_id=ahead.snapshot_id, size_bytes=size)

    async def abort(self, sandbox_id: str) -> bool:
        """The move did not happen: the disk merged back into one file, the pre-copy
        snapshot dropped, the lock released if the pre-copy still holds it. Returns whether
        there was a pre-copy."""
        ahead = self._ahead.pop(sandbox_id, None)
        if ahead is None:
            return False
        try:
            if ahead.split:
                await self.driver.merge_disk(
                    self.registry.directory(sandbox_id), self.registry.vm(sandbox_id)
                )
        finally:
            if ahead.lock is not None and ahead.lock.locked():
                ahead.lock.release()
            await self._drop(ahead.snapshot_id)
        return True

    async def finish(self, sandbox_id: str) -> None:
        """The destination has the sandbox (its VM and files here are gone): the pre-copy
        snapshot goes too."""
        ahead = self._ahead.pop(sandbox_id, None)
        if ahead is not None:
            await self._drop(ahead.snapshot_id)

    # -- the destination -----------------------------------------------------------------

    async def take(self, body: PrecopyTake) -> PrecopyTaken:
        """Pulls what the source offers ahead of the sandbox's freeze (see the module's
        doc); a later `Moves.take_in` of that sandbox uses it."""
        offer = body.offer
        sandbox_id = offer.sandbox_id
        have = self.store.get_sandbox(sandbox_id)
        if have is not None and have.state != S.deleted:
            raise errors.Conflict(f"this node already has sandbox {sandbox_id}")
        await self.drop(sandbox_id)
        source = NodeSource(body.source_url, body.source_key, body.source_ca)
        staged = self._staged[sandbox_id] = Staged()
        started = time.monotonic()
        sent = 0
        if offer.ram_sha256 is not None:  # first: snapshots below may sit on the same file
            staged.directory = self.snapshots.root / f".precopy-{sandbox_id}"
            shutil.rmtree(staged.directory, ignore_errors=True)
            staged.directory.mkdir(parents=True)
            ram = staged.directory / "ram.base"
            sent += await source.pull_path(
                f"/v1/sandboxes/{sandbox_id}/precopy/ram", f"sandbox {sandbox_id}'s RAM", ram
            )
            if await asyncio.to_thread(sha256_of, ram) != offer.ram_sha256:
                raise errors.SnapshotCorrupt(
                    f"the RAM file of sandbox {sandbox_id} does not match its digest"
                )
            ram.chmod(0o400)
            staged.ram_sha256 = offer.ram_sha256
        pull = self.pull(sandbox_id, source.pull)

        async def counting(snapshot_id: str, name: str, dest: Path) -> object:
            nonlocal sent
            got = await pull(snapshot_id, name, dest)
            sent += got if isinstance(got, int) else 0
            return got

        async def fetch(snapshot_id: str) -> SnapshotExport:
            # the snapshots its disk sits on as they are: a move's earlier one (a RAM layer)
            # is not flattened under the running sandbox that maps its RAM file
            export = await source.export(snapshot_id, layers=True)
            self.expect(sandbox_id, export)
            return export

        if offer.snapshot_id is not None:
            snap = await self.shipping.take_in(await fetch(offer.snapshot_id), fetch, counting)
            staged.snapshot_id = snap.id
        return PrecopyTaken(bytes=sent, pull_ms=round((time.monotonic() - started) * 1000, 1))

    def expect(self, sandbox_id: str, export: SnapshotExport) -> None:
        """Notes the RAM file a snapshot taken in for the sandbox's move sits on."""
        staged = self._staged.get(sandbox_id)
        wanted = export.manifest.get("sha256", {}).get("ram.base")
        if staged is not None and wanted:
            staged.digests[export.snapshot.id] = wanted

    def pull(self, sandbox_id: str, pull: Pull) -> Pull:
        """`pull` for the snapshots of the sandbox's move: the RAM file under a layer is
        taken from what was staged ahead when its digest is the one that snapshot's export
        names (`expect`): a link, no byte travels."""

        async def pulling(snapshot_id: str, name: str, dest: Path) -> object:
            staged = self._staged.get(sandbox_id)
            if (
                staged is not None
                and staged.directory is not None
                and name == "ram.base"
                and staged.ram_sha256 is not None
                and staged.digests.get(snapshot_id) == staged.ram_sha256
            ):
                os.link(staged.directory / "ram.base", dest)
                return 0
            return await pull(snapshot_id, name, dest)

        return pulling

    def settled(self, sandbox_id: str) -> None:
        """The sandbox is taken in: what was staged for it is its snapshots' now (the
        pre-copy snapshot stays as the base of the move's)."""
        staged = self._staged.pop(sandbox_id, None)
        if staged is not None and staged.directory is not None:
            shutil.rmtree(staged.directory, ignore_errors=True)

    async def drop(self, sandbox_id: str) -> None:
        """What was staged here for a move of the sandbox that did not happen goes."""
        staged = self._staged.pop(sandbox_id, None)
        if staged is None:
            return
        if staged.directory is not None:
            shutil.rmtree(staged.directory, ignore_errors=True)
        await self._drop(staged.snapshot_id)

    async def _drop(self, snapshot_id: str | None) -> None:
        snap = self.store.get_snapshot(snapshot_id) if snapshot_id else None
        if snap is not None:
            with contextlib.suppress(errors.CellaError):
                await self.snapshots.delete(snap.tenant, snap.id)

    def _row(self, sandbox_id: str) -> SandboxRecord:
        row = self.store.get_sandbox(sandbox_id)
        if row is None or row.state == S.deleted:
            raise errors.NotFound(f"no sandbox {sandbox_id!r}")
        return row
