"""The fleet's signing keys: each node signs with its own (no private key leaves its node),
and the gateway publishes the union of the nodes' public keys, so a verifier pointed at
the gateway's `/.well-known/jwks.json` accepts what any member signed. A node that is not
up is left out: its sandboxes are lost, and so are the tokens that name them."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from cella.fleet.membership import Membership
from cella.fleet.node_client import Node

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
