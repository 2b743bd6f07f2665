"""What the gateway asks Ray: which nodes run sandboxes and whether they are alive, and the
node daemon on each (created where missing). Blocking calls; the gateway runs them in
threads."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cella.fleet import rayauth
from cella.fleet.node_actor import NAMESPACE, RESOURCE, NodeDaemon, actor_name, node_name

log = logging.getLogger("cella.fleet")


@dataclass(frozen=True, slots=True)
class RayNode:
    node_id: str
    name: str
    alive: bool
    address: str
    labels: dict[str, str] = field(default_factory=dict)


def connect(address: str, allow_unauthenticated: bool = False) -> bool:
    """Joins the cluster as a driver (`auto`: the cluster this host belongs to); False when
    this process already was one. A cluster without token authentication is refused unless
    `allow_unauthenticated` (see `rayauth`)."""
    if ray.is_initialized():
        return False
    rayauth.check(address, allow_unauthenticated)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(
        address=address,
        namespace=NAMESPACE,
        log_to_driver=False,
        logging_level=logging.WARNING,
        configure_logging=False,
    )
    return True


def nodes() -> list[RayNode]:
    """The nodes with the `cella_node` resource that Ray knows of, alive or dead (a node
    Ray has forgotten is as lost as a dead one)."""
    found = []
    for n in ray.nodes():  # type: ignore[no-untyped-call]
        if RESOURCE not in (n.get("Resources") or {}):
            continue
        labels = dict(n.get("Labels") or {})
        found.append(
            RayNode(
                node_id=n["NodeID"],
                name=node_name(n["NodeID"], labels),
                alive=bool(n.get("Alive")),
                address=str(n.get("NodeManagerAddress", "")),
                labels=labels,
            )
        )
    return found


def addresses() -> set[str]:
    """The address of every node Ray knows, sandbox nodes or not (the head runs the GCS)."""
    return {
        str(n["NodeManagerAddress"])
        for n in ray.nodes()  # type: ignore[no-untyped-call]
        if n.get("NodeManagerAddress")
    }


def daemon_of(node: RayNode, data_root: str, timeout: float = 240.0) -> dict[str, Any]:
    """The node daemon's `info()` (started there if it is not running yet)."""
    actor = NodeDaemon.options(  # type: ignore[attr-defined]
        name=actor_name(node.node_id),
        namespace=NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False),
    ).remote(data_root, node.name, node.labels)
    info: dict[str, Any] = ray.get(actor.info.remote(), timeout=timeout)
    return info


def stop_daemon(node_id: str) -> None:
    """Ends the node's daemon and its actor for good (an actor is a leased worker, and a
    node with one is never idle to Ray's autoscaler)."""
    try:
        actor = ray.get_actor(actor_name(node_id), namespace=NAMESPACE)
    except ValueError:  # none there
        return
    ray.kill(actor, no_restart=True)
