"""A sandbox's exec policy: kept in its row, handed to its guest whenever a VM of it is
made ready (create, fork, resume, adoption) and when it changes while it runs; the guest's
refusals become `exec_denied` events in its trace."""

from __future__ import annotations

import functools

from cella import errors
from cella.guest.protocol import ExecDenied
from cella.models import ExecPolicy, SandboxState
from cella.policy.access import Permission, Principal
from cella.runtime.contract import VM
from cella.service.registry import Registry
from cella.store import SandboxRecord


class ExecPolicies:
    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    def get(self, who: Principal, sandbox_id: str) -> ExecPolicy:
        return self.registry.get(who, sandbox_id).exec_policy or ExecPolicy()

    async def set(self, who: Principal, sandbox_id: str, policy: ExecPolicy) -> ExecPolicy:
        """Replaces the policy (a caller who manages the sandbox). Written first; a running
        guest takes it at once (a paused one when it resumes, a stopped one when it boots);
        a guest that cannot take it leaves the old one in place, and the call fails."""
        async with self.registry.lock(sandbox_id):
            row = self.registry.get(who, sandbox_id, Permission.manage)
            before = row.exec_policy
            kept = None if policy.inert else policy
            self.registry.update(sandbox_id, exec_policy=kept)
            vm = self.registry.vm(sandbox_id)
            if row.state == SandboxState.running and vm is not None:
                try:
                    await push(vm, kept)
                except BaseException:
                    self.registry.update(sandbox_id, exec_policy=before)
                    raise
            self.registry.events.emit(sandbox_id, "exec_policy_changed", policy.model_dump())
        return policy

    async def apply(self, vm: VM, row: SandboxRecord, *, clean: bool = False) -> None:
        """A VM of the sandbox made ready: its refusals are traced, and its guest holds the
        sandbox's policy (a guest restored from another's memory may hold another's).
        `clean`: the guest holds none (booted, or restored from a template's warm
        snapshot), so a sandbox without one costs no round trip."""
        self.attach(vm, row)
        if row.exec_policy is not None or not clean:
            await push(vm, row.exec_policy, quiet=row.exec_policy is None)

    def attach(self, vm: VM, row: SandboxRecord) -> None:
        vm.agent.on_exec_denied = functools.partial(self._denied, row.id)

    def _denied(self, sandbox_id: str, denied: ExecDenied) -> None:
        self.registry.events.emit(
            sandbox_id,
            "exec_denied",
            {
                "path": denied.path,
                "sha256": denied.sha256,
                "pid": denied.pid,
                "argv": denied.argv,  # the process that tried (the new program never ran)
                "suppressed_before": denied.suppressed,
            },
        )


async def push(vm: VM, policy: ExecPolicy | None, quiet: bool = False) -> None:
    """Hands the policy to the guest. `quiet`: an agent that predates exec policies is
    fine when there is none to hold."""
    policy = policy or ExecPolicy()
    rules = [
        (r.action == "deny", "sha256" if r.sha256 else "path_glob", r.sha256 or r.path_glob or "")
        for r in policy.rules
    ]
    try:
        await vm.agent.set_exec_policy(policy.default == "deny", rules)
    except errors.InvalidArgument as exc:
        if quiet and "unknown message type" in exc.message:
            return
        if "unknown message type" in exc.message:
            raise errors.InvalidState(
                "this sandbox's guest agent predates exec policies (it was restored from "
                "an older snapshot): recreate it to use one"
            ) from None
        raise
