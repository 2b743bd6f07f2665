"""A tenant's image registries on a fleet: kept by the gateway (in its store, the password
sealed under its secrets key, as a node daemon keeps them) and served by the same routes a
node serves. No node holds them: a build that pulls with one goes to a node with a copy
lent for that request alone, made there under a name of its own and deleted once the node
has answered (a node reads a registry's credentials when it takes the build, before it
answers; the pull itself runs later with what it read)."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Awaitable, Callable
from typing import TypeVar

from cella import errors
from cella.fleet.node_client import Node
from cella.service.image_registries import ImageRegistries
from cella.service.image_snapshots import registry_reference
from cella.service.keys import Principal

T = TypeVar("T")
log = logging.getLogger(__name__)
LENT_PREFIX = "fleet-lent-"


async def build_with(
    node: Node,
    who: Principal,
    registries: ImageRegistries,
    registry: str | None,
    image: str,
    send: Callable[[str | None], Awaitable[T]],
) -> T:
    """`send(the node's id of the registry, or None)`: a build of `image` on `node`, with the
    caller's `registry` lent to the node for it. A registry that is not the caller's, or
    not the image's host, is refused here, by the names the caller knows."""
    if registry is None:
        return await send(None)
    row = registries.get(who.tenant, registry)
    registries.credentials(who.tenant, registry, registry_reference(image))
    copy = {"name": f"{LENT_PREFIX}{secrets.token_hex(8)}", "url": row.url}
    if row.username is not None and row.password is not None:
        copy |= {"username": row.username, "password": row.password}
    made = await node.json("POST", "/v1/registries", who, json=copy)
    try:
        return await send(str(made["id"]))
    finally:
        try:
            await node.json("DELETE", f"/v1/registries/{made['id']}", who)
        except errors.CellaError as exc:  # the build's answer stands; the copy stays sealed
            log.warning("node %s kept lent registry %s: %s", node.name, made["id"], exc)
