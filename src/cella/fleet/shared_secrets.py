"""Tenants' secrets on a fleet: kept by the gateway (sealed under its own key) and copied to
every node, since a sandbox may be placed on any; a node that joins gets them all first."""

from __future__ import annotations

from cella import errors
from cella.fleet.membership import Membership
from cella.fleet.node_client import Node, raise_for
from cella.models.network import SecretPut
from cella.service.keys import Principal
from cella.store import SecretRecord, Store, sealing
from cella.store.sealing import KeyFile


class SharedSecrets:
    def __init__(self, store: Store, key: KeyFile | None, membership: Membership) -> None:
        self.store = store
        self.key = key
        self.membership = membership

    def list(self, tenant: str) -> list[SecretRecord]:
        return self.store.list_secrets(tenant)

    def get(self, tenant: str, name: str) -> SecretRecord:
        found = self.store.get_secret(tenant, name)
        if found is None:
            raise errors.NotFound(f"no secret {name!r}")
        return found

    async def put(self, who: Principal, name: str, body: SecretPut) -> None:
        self.store.put_secret(SecretRecord.put(who.tenant, name, body))
        await self.membership.each("PUT", f"/v1/secrets/{name}", who, json=body.model_dump())

    async def delete(self, who: Principal, name: str) -> None:
        if not self.store.delete_secret(who.tenant, name):
            raise errors.NotFound(f"no secret {name!r}")
        for node in self.membership.healthy():
            answer = await node.call("DELETE", f"/v1/secrets/{name}", who)
            if answer.status_code != 404:  # a node that joined after a failed push
                raise_for(answer, node.name)

    async def push_to(self, node: Node) -> None:
        """A joining node gets every tenant's secrets (their values stay write-only)."""
        for record in self.store.list_secrets(None):
            body = SecretPut.model_validate(
                {
                    "value": record.value,
                    "hosts": record.hosts,
                    "auth": record.auth,
                    "username": record.username or "x-access-token",
                    "inject": record.inject,
                    "metadata": record.metadata,
                }
            )
            who = Principal(tenant=record.tenant, admin=False)
            await node.json("PUT", f"/v1/secrets/{record.name}", who, json=body.model_dump())

    async def rotate_key(self) -> int:
        """A new key for the gateway's copy of the secrets, and for every node's; returns
        how many values the gateway resealed. A node that does not answer is an error (its
        old key would hold on)."""
        resealed = sealing.rotate(self.key, self.store)
        for node in self.membership.healthy():
            await node.json("POST", "/v1/secrets-key/rotate")
        return resealed
