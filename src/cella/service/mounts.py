"""A sandbox's git mounts: cloned into the guest when it is created, fetched and reset to
their ref every `refresh_interval_seconds` while it runs, and on request.

git runs in the guest as argv through the exec room (every operand after `--`), so its
traffic leaves like any other: through the egress proxy, under the sandbox's rules, with
header rules adding credentials the guest never sees. A refresh loop lives while the
sandbox's VM does (started when the registry tracks a VM, cancelled when it lets go of it:
stop, delete, shutdown), so a stopped sandbox is never woken for it, and a resumed, forked
or re-adopted one refreshes again. Upkeep does not count as activity: a sandbox whose only
work is its refreshes still goes idle.
"""

from __future__ import annotations

import asyncio
import logging

from cella import errors
from cella.models import ExecRequest, GitMount, MountRefresh, SandboxState
from cella.policy.access import Permission, Principal
from cella.service.background import Background
from cella.service.exec import Exec
from cella.service.registry import Registry

log = logging.getLogger("cella.mounts")
GIT_TIMEOUT = 600.0  # one clone or fetch
# no prompt for credentials (a 401 fails), no credential helper, no hooks from the repo
GIT_ENV = {"GIT_TERMINAL_PROMPT": "0", "GIT_ASKPASS": "", "GCM_INTERACTIVE": "never"}
GIT = ["git", "-c", "credential.helper=", "-c", "core.hooksPath=/dev/null"]


class Mounts:
    def __init__(self, registry: Registry, exec_: Exec, background: Background) -> None:
        self.registry = registry
        self.exec = exec_
        self.background = background
        self._loops: dict[str, asyncio.Task[None]] = {}
        self._locks: dict[str, asyncio.Lock] = {}  # one git at a time per sandbox
        self._commits: dict[str, dict[str, str]] = {}  # the commit each mount was last at
        registry.track_hooks.append(self.watch)
        registry.untrack_hooks.append(self.unwatch)
        registry.forget_hooks.append(self._forget)

    # -- clone and refresh ----------------------------------------------------------------

    async def clone_all(self, who: Principal, sandbox_id: str) -> None:
        """Clones every mount of a new sandbox; the first that fails raises `MountFailed`
        naming it."""
        row = self.registry.get(who, sandbox_id)
        async with self._lock(sandbox_id):
            for mount in row.mounts:
                argv = [*GIT, "clone", "--quiet"]
                if mount.ref is not None:
                    argv += ["--branch", mount.ref.name]
                await self._git(who, sandbox_id, mount, [*argv, "--", mount.url, mount.path])
                commit = await self._head(who, sandbox_id, mount, True)
                self._commits.setdefault(sandbox_id, {})[mount.id] = commit
                self.registry.events.emit(
                    sandbox_id,
                    "mount_cloned",
                    {"mount": mount.id, "url": mount.url, "commit": commit},
                )

    async def refresh(
        self, who: Principal, sandbox_id: str, mount_id: str | None = None, activity: bool = True
    ) -> list[MountRefresh]:
        """Fetches each mount (or the one named) and resets it to its ref; the commits
        they are at now (a caller who may exec in the sandbox)."""
        row = self.registry.get(who, sandbox_id, Permission.exec)
        mounts = [m for m in row.mounts if mount_id is None or m.id == mount_id]
        if mount_id is not None and not mounts:
            raise errors.NotFound(f"sandbox {sandbox_id} has no mount {mount_id!r}")
        out = []
        async with self._lock(sandbox_id):
            for mount in mounts:
                ref = mount.ref.refspec if mount.ref is not None else "HEAD"
                at = ["-C", mount.path]
                await self._git(who, sandbox_id, mount, [*GIT, *at, "fetch", "--quiet",
                                "--no-tags", "origin", "--", ref], activity)  # fmt: skip
                await self._git(who, sandbox_id, mount, [*GIT, *at, "reset", "--quiet",
                                "--hard", "FETCH_HEAD", "--"], activity)  # fmt: skip
                commit = await self._head(who, sandbox_id, mount, activity)
                known = self._commits.setdefault(sandbox_id, {})
                if known.get(mount.id, commit) != commit:  # news only
                    self.registry.events.emit(
                        sandbox_id, "mount_updated", {"mount": mount.id, "commit": commit}
                    )
                known[mount.id] = commit
                out.append(MountRefresh(id=mount.id, commit=commit))
        return out

    async def _head(self, who: Principal, sandbox_id: str, mount: GitMount, activity: bool) -> str:
        argv = [*GIT, "-C", mount.path, "rev-parse", "HEAD"]
        return (await self._git(who, sandbox_id, mount, argv, activity)).strip()

    async def _git(
        self,
        who: Principal,
        sandbox_id: str,
        mount: GitMount,
        argv: list[str],
        activity: bool = True,
    ) -> str:
        req = ExecRequest(command=argv, env=GIT_ENV, timeout=GIT_TIMEOUT)
        result = await self.exec.run(who, sandbox_id, req, keep=64 << 10, activity=activity)
        if result.exit_code != 0 or result.timed_out:
            why = result.stderr.decode(errors="replace").strip().splitlines()
            detail = why[-1] if why else f"exit status {result.exit_code}"
            raise errors.MountFailed(f"mount {mount.id!r} ({mount.url}): git {argv[len(GIT)]}"
                              f" failed: {detail}")  # fmt: skip
        return result.stdout.decode(errors="replace")

    def _lock(self, sandbox_id: str) -> asyncio.Lock:
        return self._locks.setdefault(sandbox_id, asyncio.Lock())

    # -- the refresh loops ----------------------------------------------------------------

    def watch(self, sandbox_id: str) -> None:
        """A sandbox's VM runs: its mounts with an interval are refreshed from now on."""
        row = self.registry.store.get_sandbox(sandbox_id)
        if row is None or sandbox_id in self._loops:
            return
        timed = [m for m in row.mounts if m.refresh_interval_seconds]
        if not timed:
            return
        task = self.background.start(
            self._loop(Principal.service(row.tenant), sandbox_id, timed),
            name=f"mounts-{sandbox_id}",
        )
        self._loops[sandbox_id] = task
        task.add_done_callback(lambda t: self._loops.pop(sandbox_id, None) if
                               self._loops.get(sandbox_id) is t else None)  # fmt: skip

    def unwatch(self, sandbox_id: str) -> None:
        """The sandbox's VM is let go (stop, delete): its refreshes end with it."""
        task = self._loops.pop(sandbox_id, None)
        if task is not None:
            task.cancel()

    def _forget(self, sandbox_id: str) -> None:
        self.unwatch(sandbox_id)
        self._locks.pop(sandbox_id, None)
        self._commits.pop(sandbox_id, None)

    async def _loop(self, who: Principal, sandbox_id: str, mounts: list[GitMount]) -> None:
        loop = asyncio.get_running_loop()
        due = {m.id: loop.time() + (m.refresh_interval_seconds or 0) for m in mounts}
        while True:
            await asyncio.sleep(max(0.0, min(due.values()) - loop.time()))
            row = self.registry.store.get_sandbox(sandbox_id)
            if row is None or row.state not in (SandboxState.running, SandboxState.paused):
                return  # gone, or stopped behind our back (a crash): resume restarts us
            for mount in mounts:
                if due[mount.id] > loop.time():
                    continue
                due[mount.id] = loop.time() + (mount.refresh_interval_seconds or 0)
                if row.state != SandboxState.running:
                    continue  # paused: no CPU to run git; the next turn tries again
                try:
                    await self.refresh(who, sandbox_id, mount.id, activity=False)
                except errors.CellaError as exc:  # the next turn tries again
                    self.registry.events.emit(
                        sandbox_id, "mount_refresh_failed", {"mount": mount.id, "error": str(exc)}
                    )
