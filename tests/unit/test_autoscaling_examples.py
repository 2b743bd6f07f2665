"""The autoscaling examples under docs/autoscaling/: a config Ray's cluster launcher accepts,
sandbox node types with the `cella_node` resource and labels that name daemon settings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from cella.config import DaemonSettings
from cella.fleet.node_actor import GROUP_LABEL, NAME_LABEL, RESOURCE, daemon_env

DOCS = Path(__file__).resolve().parents[2] / "docs" / "autoscaling"


def load(name: str) -> dict[str, Any]:
    found: dict[str, Any] = yaml.safe_load((DOCS / name).read_text())
    return found


def settings_named(labels: dict[str, str]) -> set[str]:
    return {k.removeprefix("CELLA_").lower() for k in daemon_env(labels)}


def test_the_cloud_config_is_one_ray_accepts() -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = load("cluster.yaml")
    validate_config(prepare_config(config))  # as `ray up` reads it, by Ray's own schema
    sandbox = config["available_node_types"]["sandbox"]
    assert sandbox["resources"] == {RESOURCE: 1}
    assert GROUP_LABEL in sandbox["labels"] and NAME_LABEL not in sandbox["labels"]
    assert settings_named(sandbox["labels"]) <= set(DaemonSettings.model_fields)
    head = config["available_node_types"][config["head_node_type"]]
    assert RESOURCE not in head["resources"]


def test_the_kuberay_fields_grow_a_group_of_named_nodes_from_none() -> None:
    spec = load("raycluster-autoscaling.yaml")["spec"]
    assert spec["enableInTreeAutoscaling"] is True
    [group] = spec["workerGroupSpecs"]
    assert group["minReplicas"] == 0 and group["resources"] == {RESOURCE: "1"}
    assert GROUP_LABEL in group["labels"]
    assert settings_named(group["labels"]) <= set(DaemonSettings.model_fields)
    [head] = spec["headGroupSpec"]["template"]["spec"]["containers"]
    env = {e["name"].removeprefix("CELLA_").lower() for e in head["env"]}
    assert env <= set(DaemonSettings.model_fields)
    assert "fleet_autoscale" in env
