"""Rewrite rules on a fleet: a rule's target may run on any node, and the gateway decides.

When a rule is set through the gateway (a create, a fork, `PUT .../network`, a LangSmith
box's rewrite rules), the gateway settles its target among the caller's sandboxes of the
whole fleet (an id, as on one daemon; refused if the caller may not exec in it) and keeps
the rule with who set it; a fork made through the gateway inherits its parent's rules here
as on its node, each with its setter (`inherit`). Each node is linked to the gateway when
it joins (`link`: the gateway's API, its pinned certificate, a key of the node's own); a
node's proxy sends every rewritten request to its daemon, which sends it here with a token
minted with that key. `check` finds the rule as it was set and its setter as they are now
(a revoked key is refused); the target's node gets the request as the setter
(`/v1/fleet/rewrites/...`), and refuses it if the setter may no longer exec in the target
(a share taken back)."""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from cella import errors
from cella.fleet.delegation import Delegations
from cella.fleet.locator import Locator
from cella.fleet.node_client import Node
from cella.models import NetworkPolicy
from cella.policy import access
from cella.policy.delegation import sandbox_of, valid
from cella.server.error_shapes import describe
from cella.service.keys import Keys, Principal
from cella.service.ports import load_key
from cella.store.sql import Database, database

SCHEMA = """
CREATE TABLE IF NOT EXISTS rewrites (
    sandbox_id TEXT NOT NULL,
    host TEXT NOT NULL,
    target TEXT NOT NULL,
    port INTEGER NOT NULL,
    setter TEXT NOT NULL,
    PRIMARY KEY (sandbox_id, host)
);
"""


@dataclass(frozen=True)
class Kept:
    """A rule as the gateway keeps it: where its host leads, and who set it."""

    target: str
    port: int
    setter: Principal


class FleetRewrites:
    def __init__(
        self,
        where: Path | str | Database,
        key_file: Path,
        locator: Locator,
        keys: Keys,
        delegations: Delegations,
    ) -> None:
        self.locator = locator
        self.keys = keys
        self.delegations = delegations  # where the nodes reach this gateway, and its pin
        self._secret = load_key(key_file)
        self._db = database(where)
        self._db.ensure("rewrites", SCHEMA)

    def link(self, node: str) -> dict[str, Any] | None:
        """What `node` is told of this gateway (None: a gateway on no one address, which
        refuses rewrites when they are set)."""
        try:
            host, port = self.delegations.address()
        except errors.InvalidArgument:
            return None
        tls = self.delegations.certificate()
        shown = f"[{host}]" if ":" in host else host
        url = f"{'https' if tls else 'http'}://{shown}:{port}"
        return {"url": url, "key": self._key(node).hex(), "tls": tls}

    async def settle(self, who: Principal, network: Any) -> Any:
        """A network policy as a create or `PUT .../network` sent it, its rewrites' targets
        made ids of the caller's sandboxes anywhere in the fleet (others refused by name)."""
        if not isinstance(network, dict) or not network.get("rewrites"):
            return network
        try:
            policy = NetworkPolicy.model_validate(network)  # refused as a node refuses it
        except ValidationError as exc:
            raise errors.InvalidArgument(describe(exc.errors())) from None
        self.delegations.address("rewrites")  # a gateway the nodes cannot reach says why
        rules = []
        for rule in policy.rewrites:
            target = await self._target(who, rule.host, rule.to.sandbox)
            rules.append({**rule.model_dump(), "to": {"sandbox": target, "port": rule.to.port}})
        return {**network, "rewrites": rules}

    def record(self, sandbox_id: str, who: Principal, network: Any) -> None:
        """The rules of a sandbox as they are now set (by `who`), in place of any before."""
        rules = network.get("rewrites") or [] if isinstance(network, dict) else []
        setter = json.dumps(
            {"tenant": who.tenant, "key_id": who.key_id, "name": who.name,
             "roles": sorted(who.roles), "read_only": who.read_only}
        )  # fmt: skip
        with self._db.transaction() as db:
            db.execute("DELETE FROM rewrites WHERE sandbox_id = ?", (sandbox_id,))
            for r in rules:
                db.execute(
                    "INSERT INTO rewrites VALUES (?, ?, ?, ?, ?)",
                    (sandbox_id, str(r["host"]).lower(), r["to"]["sandbox"], r["to"]["port"],
                     setter),
                )  # fmt: skip

    def inherit(self, sandbox_id: str, parent_id: str) -> None:
        """A fork's rules: its parent's as they were kept here, each with its setter."""
        with self._db.transaction() as db:
            db.execute("DELETE FROM rewrites WHERE sandbox_id = ?", (sandbox_id,))
            db.execute(
                "INSERT INTO rewrites SELECT ?, host, target, port, setter FROM rewrites "
                "WHERE sandbox_id = ?",
                (sandbox_id, parent_id),
            )

    def check(self, sandbox_id: str, host: str, token: str) -> tuple[Kept, Node]:
        """The rule a node's request is for, its setter as they are now, and the node of
        its target; refused if the token is not the sandbox's node's."""
        where = self.locator.placements.get(sandbox_id)
        fresh = where is not None and sandbox_of(token) == sandbox_id
        if where is None or not fresh or not valid(token, self._key(where.node)):
            raise errors.PermissionDenied("not a rewrite token of the sandbox's node")
        row = self._db.execute(
            "SELECT target, port, setter FROM rewrites WHERE sandbox_id = ? AND host = ?",
            (sandbox_id, host.lower()),
        ).fetchone()
        if row is None:
            raise errors.NotFound(f"sandbox {sandbox_id} has no rewrite for {host}")
        kept = Kept(str(row[0]), int(row[1]), self._setter(json.loads(row[2]), host))
        target = self.locator.placements.get(kept.target)
        if target is None or target.tenant != where.tenant:
            raise errors.SandboxUnavailable(
                f"{host}: sandbox {kept.target} no longer exists (rewrite rule)"
            )
        if target.body.get("state") in ("deleting", "deleted"):
            raise errors.SandboxUnavailable(
                f"{host}: sandbox {kept.target} no longer exists (rewrite rule)"
            )
        return kept, self.locator.usable(target)

    def _setter(self, saved: dict[str, Any], host: str) -> Principal:
        """Who set the rule, as their key says now (an admin key acting for the tenant: as
        it acted); refused once the key is revoked."""
        roles = frozenset(access.Role(r) for r in saved["roles"])
        setter = Principal(saved["tenant"], False, bool(saved["read_only"]), saved["key_id"],
                           saved["name"], roles)  # fmt: skip
        if setter.key_id is None:
            return setter
        now = self.keys.by_id(setter.key_id)
        if now is None:
            raise errors.PermissionDenied(f"rewrite {host}: the key that set the rule is revoked")
        return now if now.tenant == setter.tenant else setter

    async def _target(self, who: Principal, host: str, given: str) -> str:
        """The id of the sandbox `given` (an id or a name) if `who` may exec in it, as its
        node says now."""
        try:
            try:
                where = await self.locator.placement(who, given)
            except errors.NotFound:
                where = await self.locator.placement_named(who, given)
            node = self.locator.usable(where)
            shown = await node.json("GET", f"/v1/sandboxes/{where.sandbox_id}/access", who)
            if shown.get("permission") not in ("exec", "manage"):
                raise errors.PermissionDenied(given)
        except (errors.NotFound, errors.PermissionDenied):
            raise errors.InvalidArgument(
                f"rewrite {host}: no sandbox {given!r} of this tenant that this key may exec in"
            ) from None
        return where.sandbox_id

    def _key(self, node: str) -> bytes:
        return hmac.new(self._secret, f"rewrites:{node}".encode(), hashlib.sha256).digest()
