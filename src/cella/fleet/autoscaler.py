"""What the gateway tells Ray's autoscaler (blocking calls; the gateway runs them in threads).

Capacity is asked for as a floor of whole `cella_node` bundles (`request_resources`: the
autoscaler keeps enough nodes for them, counted against what nodes have, not what is free).
A node with sandboxes is held by a detached placement group of a sliver of its `cella_node`,
pinned to it by its node-id label: a node with a claim on it is never idle, so Ray's
autoscaler (v1 by its idle timeout, v2 by its drain, which a busy node refuses) never removes
it, and the claim outlives the gateway. The node daemon's actor claims nothing, so a node
without sandboxes and without a hold is idle and goes.
"""

from __future__ import annotations

from ray.autoscaler.sdk import request_resources
from ray.util.placement_group import (
    PlacementGroup,
    get_placement_group,
    placement_group,
    placement_group_table,
    remove_placement_group,
)

from cella.fleet.node_actor import RESOURCE

HOLD_PREFIX = "cella-hold-"
HOLD = {RESOURCE: 0.001}  # a claim small enough to fit beside anything on the node
NODE_ID_LABEL = "ray.io/node-id"


def ask(nodes: int) -> None:
    """The cluster should have `nodes` sandbox nodes (0: no floor; idle nodes may go)."""
    request_resources(bundles=[{RESOURCE: 1}] * nodes)


def holds() -> set[str]:
    """The NodeIDs held now."""
    table = placement_group_table()
    return {
        pg["name"][len(HOLD_PREFIX) :]
        for pg in table.values()
        if pg.get("name", "").startswith(HOLD_PREFIX) and pg.get("state") != "REMOVED"
    }


def hold(node_id: str) -> None:
    """Claims a sliver of the node's `cella_node` until `release` (idempotent)."""
    if node_id in holds():
        return
    placement_group(
        [HOLD],
        strategy="STRICT_PACK",
        name=HOLD_PREFIX + node_id,
        lifetime="detached",
        bundle_label_selector=[{NODE_ID_LABEL: node_id}],
    )


def release(node_id: str) -> None:
    try:
        group: PlacementGroup = get_placement_group(HOLD_PREFIX + node_id)
    except ValueError:  # not held
        return
    remove_placement_group(group)
