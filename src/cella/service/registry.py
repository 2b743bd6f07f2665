"""The registry: what every other room of the service shares about sandboxes.

It owns the sandbox rows as the service reads and writes them (each one a caller asks for
checked with the access rule, `cella.policy.access`, in `owned`), one lock per sandbox, the
live VMs, activity (last touch, execs under way) and the crash watch: a VM that ends
without being asked to turns its sandbox `stopped`, with the reason, disk kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cella import errors
from cella.models import SandboxState
from cella.policy import access
from cella.policy.access import Permission, Principal
from cella.runtime.contract import VM, Driver
from cella.store import SandboxRecord, Store
from cella.store.records import LIVE_STATES
from cella.telemetry.events import EventLog

log = logging.getLogger("cella.service")
S = SandboxState
MAX_ERROR = 2000


HELD = (S.paused, S.stopped)  # states whose time a `running` lifetime clock leaves out


def iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).isoformat()


def access_of(row: SandboxRecord) -> access.Access:
    """What the access rule needs of a sandbox's row."""
    shares = {p: Permission[level] for p, level in row.shares.items()}
    visibility: access.Visibility = "private" if row.visibility == "private" else "tenant"
    return access.Access(row.tenant, row.creator, visibility, shares)


def error_text(exc: BaseException) -> str:
    text = str(exc) if isinstance(exc, errors.CellaError) else repr(exc)
    return text[:MAX_ERROR]


class Registry:
    def __init__(
        self, store: Store, driver: Driver, events: EventLog, console_limit: int = 1 << 20
    ) -> None:
        self.console_limit = console_limit  # bytes of guest console kept on the host
        self.store = store
        self.driver = driver
        self.events = events
        self._vms: dict[str, VM] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._touched: dict[str, float] = {}
        self._busy: dict[str, int] = {}
        self._watchers: set[asyncio.Task[None]] = set()
        self.forget_hooks: list[Callable[[str], None]] = []  # a sandbox was deleted
        self.track_hooks: list[Callable[[str], None]] = []  # a sandbox's VM runs (again)
        self.untrack_hooks: list[Callable[[str], None]] = []  # it was stopped or deleted

    # -- rows ----------------------------------------------------------------------------

    def get(
        self, who: Principal, sandbox_id: str, need: Permission = Permission.view
    ) -> SandboxRecord:
        """The caller's sandbox, if it may do `need` with it. Deleted ones, other tenants'
        and those the caller may not see are `NotFound` alike (nothing tells them apart);
        one it sees but may not do `need` with is `PermissionDenied`."""
        row = self.owned(who, sandbox_id, need)
        if row.state == S.deleted:
            raise errors.NotFound(f"no sandbox {sandbox_id!r}")
        return row

    def owned(
        self, who: Principal, sandbox_id: str, need: Permission = Permission.view
    ) -> SandboxRecord:
        """As `get`, deleted ones included (their traces stay readable): the one place the
        service asks `cella.policy.access` about a sandbox."""
        row = self.store.get_sandbox(sandbox_id)
        have = None if row is None else self.permission(who, row)
        if row is None or have is None:
            raise errors.NotFound(f"no sandbox {sandbox_id!r}")
        if have < need:
            raise errors.PermissionDenied(
                f"sandbox {sandbox_id}: this key may {have.name} it, not {need.name} it"
            )
        return row

    def row(self, sandbox_id: str) -> SandboxRecord:
        """A row the service itself holds an id of (no tenant check)."""
        row = self.store.get_sandbox(sandbox_id)
        if row is None:
            raise errors.NotFound(f"no sandbox {sandbox_id!r}")
        return row

    def permission(self, who: Principal, row: SandboxRecord) -> Permission | None:
        """What `who` may do with the sandbox of `row` (None: not even see it)."""
        return access.permission(who, access_of(row))

    def sees(self, who: Principal, row: SandboxRecord) -> bool:
        return self.permission(who, row) is not None

    def find(
        self,
        who: Principal | None,
        state: str | None = None,
        labels: dict[str, str] | None = None,
    ) -> list[SandboxRecord]:
        """The sandboxes `who` may see (None: every tenant's)."""
        states = [state] if state else [s.value for s in S if s != S.deleted]
        rows = self.store.list_sandboxes(who.tenant if who else None, states)
        if who is not None:
            rows = [r for r in rows if self.sees(who, r)]
        if labels:
            rows = [r for r in rows if all(r.labels.get(k) == v for k, v in labels.items())]
        return rows

    def named(self, who: Principal, name: str, need: Permission = Permission.view) -> SandboxRecord:
        """The sandbox `who` means by `name` among those it may see (`access.meant`: its
        own, else the tenant's, else the only other one); several it could mean equally
        are a `Conflict` naming their ids (all of which it sees)."""
        rows = self.store.sandboxes_named(who.tenant, name)
        picked = access.meant(who, [access_of(r) for r in rows])
        if not picked:
            raise errors.NotFound(f"no sandbox named {name!r}")
        if len(picked) > 1:
            ids = ", ".join(rows[i].id for i in picked)
            raise errors.Conflict(
                f"this key may see {len(picked)} sandboxes named {name!r} ({ids}): "
                "address one by its id"
            )
        try:
            return self.get(who, rows[picked[0]].id, need)
        except errors.NotFound:
            raise errors.NotFound(f"no sandbox named {name!r}") from None

    def check_name(
        self, tenant: str, creator: str | None, name: str | None, exclude: str | None = None
    ) -> None:
        """Refuses `name` for a sandbox of `creator` (being made, renamed, or made visible
        to the tenant; call under a lock) when the creator has a sandbox of that name or
        the tenant sees one (`access.names_clash`): sandboxes the caller sees anyway. A
        private sandbox of someone else is never the reason, nor named."""
        if name is None:
            return
        for row in self.store.sandboxes_named(tenant, name):
            if row.id != exclude and access.names_clash(creator, access_of(row)):
                raise errors.AlreadyExists(f"sandbox name {name!r} is in use")

    def live_rows(self) -> list[SandboxRecord]:
        return self.store.list_sandboxes(None, [s.value for s in LIVE_STATES])

    def live_usage(self) -> dict[str, tuple[int, int, int]]:
        """(live sandboxes, their vCPUs, their MiB) per tenant."""
        return self.store.usage_by_tenant([s.value for s in LIVE_STATES])

    def insert(self, record: SandboxRecord) -> SandboxRecord:
        return self.store.insert_sandbox(record)

    def insert_many(self, records: list[SandboxRecord]) -> list[SandboxRecord]:
        return self.store.insert_sandboxes(records)

    def update(self, sandbox_id: str, **fields: Any) -> None:
        """Writes fields of a row (a state is written before it is acted on). A sandbox
        that comes to be paused or stopped starts a hold, and one that runs again adds the
        hold to `held_seconds` (what a `running` lifetime clock leaves out)."""
        state = fields.get("state")
        if state in HELD or state == S.running:
            row = self.store.get_sandbox(sandbox_id)
            now = time.time()
            if row is not None and state in HELD and row.held_since is None:
                fields["held_since"] = iso(now)
            elif row is not None and state == S.running and row.held_since is not None:
                fields["held_seconds"] = row.held(now)
                fields["held_since"] = None
        self.store.update_sandbox(sandbox_id, **fields)

    def fail(self, sandbox_id: str, exc: BaseException, event: str | None = None) -> None:
        """Marks a sandbox as failed (`error`, with the reason), optionally with an event."""
        message = error_text(exc)
        self.store.update_sandbox(sandbox_id, state=S.error, pid=None, error=message)
        if event:
            self.events.emit(sandbox_id, event, {"error": message})

    def directory(self, sandbox_id: str) -> Path:
        return self.driver.paths.vms / sandbox_id

    def disk_bytes(self, sandbox_id: str) -> int:
        """Host disk the sandbox's disks take (allocated blocks, not their size)."""
        return self.driver.disk_bytes(self.directory(sandbox_id))

    # -- locks ---------------------------------------------------------------------------

    def lock(self, sandbox_id: str) -> asyncio.Lock:
        return self._locks.setdefault(sandbox_id, asyncio.Lock())

    def forget(self, sandbox_id: str) -> None:
        """A deleted sandbox: nothing more is kept for it."""
        for hook in self.forget_hooks:
            hook(sandbox_id)
        self._locks.pop(sandbox_id, None)
        self._touched.pop(sandbox_id, None)
        self._busy.pop(sandbox_id, None)

    # -- VMs -----------------------------------------------------------------------------

    def vm(self, sandbox_id: str) -> VM | None:
        return self._vms.get(sandbox_id)

    def vms(self) -> dict[str, VM]:
        return dict(self._vms)

    def live(
        self,
        who: Principal,
        sandbox_id: str,
        activity: bool = True,
        need: Permission = Permission.exec,
    ) -> tuple[SandboxRecord, VM]:
        """A running sandbox and its VM; the call counts as activity unless told not to
        (the daemon's own upkeep, which must not keep a sandbox from going idle)."""
        row = self.get(who, sandbox_id, need)
        vm = self._vms.get(sandbox_id)
        if row.state != S.running or vm is None:
            raise errors.InvalidState(f"sandbox {sandbox_id} is {row.state}, not running")
        if activity:
            self.touch(sandbox_id)
        return row, vm

    def live_pids(self) -> set[int]:
        return {vm.pid for vm in self._vms.values() if vm.pid is not None}

    def track(self, sandbox_id: str, vm: VM) -> None:
        """Owns the VM from now on, and watches for it to end unasked."""
        self._vms[sandbox_id] = vm
        task = asyncio.create_task(self._watch(sandbox_id, vm), name=f"watch-{sandbox_id}")
        self._watchers.add(task)
        task.add_done_callback(self._watchers.discard)
        for hook in self.track_hooks:
            hook(sandbox_id)

    def untrack(self, sandbox_id: str) -> VM | None:
        """Takes the VM out of the registry: its end is expected from now on."""
        for hook in self.untrack_hooks:
            hook(sandbox_id)
        return self._vms.pop(sandbox_id, None)

    async def _watch(self, sandbox_id: str, vm: VM) -> None:
        ended = asyncio.ensure_future(vm.wait())
        broken = asyncio.ensure_future(vm.agent.wait_closed())
        try:
            while not ended.done():
                waiting = {ended} if broken.done() else {ended, broken}
                await asyncio.wait(waiting, timeout=1.0, return_when="FIRST_COMPLETED")
                vm.trim_console(self.console_limit)
                if broken.done() and waiting != {ended}:
                    # a VM that dies closes its channel as a crash; anything else while it
                    # runs on means the guest broke the protocol
                    why = broken.result()
                    crashed = isinstance(why, errors.SandboxCrashed)
                    if not crashed and not ended.done() and self.vm(sandbox_id) is vm:
                        self._agent_broken(sandbox_id, why)
        finally:
            broken.cancel()
            ended.cancel()
        if self._vms.get(sandbox_id) is not vm:
            return  # stopped, deleted or replaced by us: an expected end
        async with self.lock(sandbox_id):
            if self._vms.get(sandbox_id) is not vm:
                return
            self._vms.pop(sandbox_id)
            reason = await vm.exit_reason()
            await vm.kill()  # releases sockets, egress address, CPU cgroup
            self.driver.clear_sockets(self.directory(sandbox_id))
            message = f"the VM exited unexpectedly ({reason}); its disk is kept: resume it"
            log.warning("%s: %s", sandbox_id, message)
            self.update(sandbox_id, state=S.stopped, pid=None, error=message)
            self.events.emit(sandbox_id, "crashed", {"reason": reason})

    def _agent_broken(self, sandbox_id: str, why: Exception) -> None:
        """The VM runs but its agent channel is unusable (the guest broke the protocol):
        the sandbox says so; stopping and resuming it gives it a fresh agent."""
        message = f"the guest agent is unusable ({why}); stop and resume the sandbox"
        log.warning("%s: %s", sandbox_id, message)
        self.update(sandbox_id, error=message[:MAX_ERROR])
        self.events.emit(sandbox_id, "agent_broken", {"reason": str(why)[:MAX_ERROR]})

    async def detach_all(self) -> None:
        """Daemon exit: let go of every VM without stopping it (the next daemon adopts)."""
        left = list(self._vms.values())
        self._vms.clear()  # watchers now see an expected end
        for task in list(self._watchers):
            task.cancel()
        for vm in left:
            await vm.detach()

    # -- activity ------------------------------------------------------------------------

    def touch(self, sandbox_id: str, force: bool = False) -> None:
        now = time.time()
        if force or now - self._touched.get(sandbox_id, 0.0) >= 1.0:  # one write a second
            self._touched[sandbox_id] = now
            self.update(sandbox_id, last_active_at=iso(now))

    @contextlib.contextmanager
    def busy(self, sandbox_id: str) -> Iterator[None]:
        """An exec under way: the sandbox is not idle, whatever the clock says."""
        self._busy[sandbox_id] = self._busy.get(sandbox_id, 0) + 1
        try:
            yield
        finally:
            self._busy[sandbox_id] -= 1
            self.touch(sandbox_id, force=True)

    def is_busy(self, sandbox_id: str) -> bool:
        return bool(self._busy.get(sandbox_id))
