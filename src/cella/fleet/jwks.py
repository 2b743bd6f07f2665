"""The fleet's signing keys: each node signs with its own (no private key leaves its node),
and the gateway publishes the union of the nodes' public keys, so a verifier pointed at
the gateway's `/.well-known/jwks.json` accepts what any member signed. A node that is not
up is left out: its sandboxes are lost, and so are the tokens that name them."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from cella import errors
from cella.fleet.membership import Membership
from cella.fleet.node_client import Node, raise_for

log = logging.getLogger(__name__)


async def fleet_jwks(membership: Membership) -> dict[str, list[dict[str, Any]]]:
    """Every healthy node's published keys, each kid once."""

    async def of(node: Node) -> list[dict[str, Any]]:
        try:
            answer = await node.call("GET", "/.well-known/jwks.json")
            keys = answer.json()["keys"] if answer.is_success else []
        except Exception as exc:  # one node's failure must not hide the others' keys
            log.warning("node %s: no signing keys: %s", node.name, exc)
            return []
        return [k for k in keys if isinstance(k, dict)]

    merged: dict[str, dict[str, Any]] = {}
    for keys in await asyncio.gather(*(of(n) for n in membership.healthy())):
        for key in keys:
            merged.setdefault(str(key.get("kid")), key)
    return {"keys": list(merged.values())}


async def fleet_signing_keys(membership: Membership) -> dict[str, list[dict[str, Any]]]:
    """Every healthy node's signing keys (admin); each node has a current one."""
    found: list[dict[str, Any]] = []
    for _, answer in await membership.each("GET", "/v1/signing-keys", None):
        found += answer["keys"]
    return {"keys": found}


async def retire_everywhere(membership: Membership, kid: str) -> None:
    """Retires `kid` on the node that has it (a kid names one node's key)."""
    retired = False
    for node in membership.healthy():
        answer = await node.call("DELETE", f"/v1/signing-keys/{kid}")
        if answer.status_code != 404:
            raise_for(answer, node.name)
            retired = True
    if not retired:
        raise errors.NotFound(f"no signing key {kid!r} on any node")
