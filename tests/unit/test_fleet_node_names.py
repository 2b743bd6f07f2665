"""How a Ray node is named in the fleet, and which of its labels become daemon settings."""

from __future__ import annotations

from cella.fleet.node_actor import daemon_env, node_name

REAL = "5f0c8b1d2e3a4b5c6d7e8f9a0b1c2d3e4f5a6b7c8d9e0f1a2b3c4d5e"
SIMULATED = [f"fffffffffffffffffffffffffffffffffffffffffffffffffff0000{i}" for i in (1, 2)]


def test_a_named_node_keeps_its_name_whatever_its_group() -> None:
    assert node_name(REAL, {"cella/node-name": "n1", "cella/node-group": "burst"}) == "n1"


def test_an_unnamed_node_is_named_by_the_start_of_its_id() -> None:
    assert node_name(REAL, {}) == "node-5f0c8b1d2e3a"


def test_the_nodes_of_a_group_share_labels_but_not_names() -> None:
    labels = {"cella/node-group": "burst"}
    names = {node_name(node_id, labels) for node_id in SIMULATED}
    assert names == {"burst-fffffff00001", "burst-fffffff00002"}
    # control: without the group they would collide (a simulated cluster's IDs start alike)
    assert len({node_name(node_id, {}) for node_id in SIMULATED}) == 1


def test_name_and_group_labels_are_not_daemon_settings() -> None:
    labels = {"cella/node-name": "n1", "cella/node-group": "burst", "cella/pool_size": "0"}
    assert daemon_env(labels) == {"CELLA_POOL_SIZE": "0"}
