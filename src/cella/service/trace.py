"""A sandbox's trace and family: its events in order (kept after it is deleted), followed
live, and the lineage tree of snapshots and forks it belongs to."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from cella.models import SandboxState
from cella.policy.access import Principal
from cella.service.registry import Registry
from cella.store import EventRecord, SandboxRecord

S = SandboxState


class Trace:
    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.store = registry.store

    def events(
        self,
        who: Principal,
        sandbox_id: str,
        after: int = 0,
        types: list[str] | None = None,
        limit: int = 1000,
        exec_id: int | None = None,
    ) -> list[EventRecord]:
        """`exec_id`: only that exec's event and the events under it (its processes)."""
        self.registry.owned(who, sandbox_id)
        return self.store.events(sandbox_id, after, limit, types, exec_id)

    async def stream(
        self,
        who: Principal,
        sandbox_id: str,
        after: int = 0,
        types: list[str] | None = None,
        follow: bool = False,
        exec_id: int | None = None,
    ) -> AsyncIterator[EventRecord]:
        """Every event after `after`; with `follow`, then new ones as they happen, until the
        sandbox is deleted (or the reader leaves)."""
        while True:
            batch = self.events(who, sandbox_id, after, types, exec_id=exec_id)
            for event in batch:
                after = event.id
                yield event
            if batch:
                continue
            if not follow:
                return
            row = self.store.get_sandbox(sandbox_id)
            if row is None or row.state in (S.deleted, S.error):
                return
            await self.registry.events.wait(sandbox_id, 5.0)

    def lineage(self, who: Principal, sandbox_id: str) -> dict[str, Any]:
        """The family tree the sandbox belongs to: from its first ancestor, every snapshot
        and fork made since (sandbox -> snapshot -> sandbox ...), of those the caller may
        see (a fork it may not see is left out, with what came of it)."""
        root = self.registry.owned(who, sandbox_id)
        tenant = root.tenant
        sandboxes = [r for r in self.store.list_sandboxes(tenant) if self.registry.sees(who, r)]
        visible = {r.id: r for r in sandboxes}
        seen = {root.id}
        while root.parent_id and root.parent_id not in seen:
            parent = visible.get(root.parent_id)
            if parent is None:
                break
            seen.add(parent.id)
            root = parent
        snapshots = self.store.list_snapshots(tenant)

        def family(row: SandboxRecord) -> dict[str, Any]:
            children = []
            for snap in snapshots:
                if snap.sandbox_id != row.id:
                    continue
                forks = [
                    family(child)
                    for child in sandboxes
                    if child.snapshot_id == snap.id and child.parent_id == row.id
                ]
                children.append(
                    {
                        "kind": "snapshot",
                        "id": snap.id,
                        "name": snap.name,
                        "state": snap.state,
                        "created_at": snap.created_at,
                        "children": forks,
                    }
                )
            return {
                "kind": "sandbox",
                "id": row.id,
                "state": row.state,
                "created_at": row.created_at,
                "children": children,
            }

        tree = family(root)
        self._scores(tenant, tree)
        return tree

    def _scores(self, tenant: str, tree: dict[str, Any]) -> None:
        """Marks the sandboxes that ran an eval task with the run, the task and its score."""
        nodes, stack = {}, [tree]
        while stack:
            node = stack.pop()
            if node["kind"] == "sandbox":
                nodes[node["id"]] = node
            stack.extend(node["children"])
        for sandbox_id, (run_id, text) in self.store.eval_results_of(tenant, nodes).items():
            result = json.loads(text)
            nodes[sandbox_id]["eval"] = {
                "run_id": run_id,
                "task_id": result["task_id"],
                "passed": result["passed"],
                "score": result["score"],
            }

    def window(
        self,
        who: Principal,
        sandbox_id: str,
        since: str | None = None,
        until: str | None = None,
        backward: bool = False,
        limit: int = 1000,
    ) -> list[EventRecord]:
        """Up to `limit` of the sandbox's events at or after `since` (forward, oldest
        first) or at or before `until` (backward, newest first); times in ISO form."""
        self.registry.owned(who, sandbox_id)
        return self.store.events_between(sandbox_id, since, until, backward, limit)
