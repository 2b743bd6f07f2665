"""The KubeRay manifest in docs/ holds what a cella fleet relies on."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from cella.config import DaemonSettings

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "docs" / "kuberay" / "raycluster.yaml"


def documents() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]


def cluster() -> dict[str, Any]:
    [found] = [d for d in documents() if d["kind"] == "RayCluster"]
    return found


def container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    [found] = [c for c in pod["spec"]["containers"] if c["name"] == name]
    return found


def mounts(c: dict[str, Any]) -> dict[str, str]:
    return {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}


def volumes(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in pod["spec"]["volumes"]}


def test_it_is_a_raycluster_of_the_pinned_ray() -> None:
    spec = cluster()
    assert spec["apiVersion"] == "ray.io/v1"
    pins = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert f"ray=={spec['spec']['rayVersion']}" in pins["optional-dependencies"]["ray"]


def test_sandbox_nodes_have_the_resource_kvm_and_their_volumes() -> None:
    groups = cluster()["spec"]["workerGroupSpecs"]
    assert groups
    for group in groups:
        assert float(group["resources"]["cella_node"]) == 1
        pod = group["template"]
        worker = container(pod, "ray-worker")
        assert worker["securityContext"]["privileged"] is True
        found = mounts(worker)
        assert volumes(pod)[found["/dev/kvm"]]["hostPath"] == {
            "path": "/dev/kvm",
            "type": "CharDevice",
        }
        env = {e["name"]: e.get("value") for e in worker["env"]}
        assert env["CELLA_IMAGE_DIR"] in found  # the image cache is a volume
        assert "hostPath" in volumes(pod)[found[env["CELLA_IMAGE_DIR"]]]
        assert "/var/lib/cella/nodes" in found  # the node root the gateway is given
        setup = pod["spec"]["initContainers"][0]
        assert setup["command"][:2] == ["cella", "setup"]


def test_node_labels_name_real_daemon_settings() -> None:
    fields = set(DaemonSettings.model_fields)
    for group in cluster()["spec"]["workerGroupSpecs"]:
        settings = [k.split("/", 1)[1] for k in group.get("labels", {}) if k.startswith("cella/")]
        assert settings
        given = {
            s.replace("-", "_"): group["labels"][f"cella/{s}"] for s in settings if s != "node-name"
        }
        assert set(given) <= fields, set(given) - fields
        DaemonSettings(**given)  # and the values are valid


def test_the_head_runs_the_gateway_and_no_sandboxes() -> None:
    head = cluster()["spec"]["headGroupSpec"]
    assert "cella_node" not in head.get("resources", {})
    pod = head["template"]
    gateway = container(pod, "cella-gateway")
    argv = gateway["command"]
    assert argv[:2] == ["cella", "serve"]
    flags = dict(zip(argv[2::2], argv[3::2], strict=True))
    assert flags["--ray"] == "auto"
    assert flags["--node-root"] == "/var/lib/cella/nodes"
    port = int(flags["--listen"].rsplit(":", 1)[1])
    # the gateway starts: its settings pass the listen check (TLS on a pod address)
    settings = DaemonSettings(
        listen=flags["--listen"], tls_cert=flags["--tls-cert"], tls_key=flags["--tls-key"]
    )
    settings.check_listen()
    with pytest.raises(ValueError, match="not a loopback address"):  # control: without TLS
        DaemonSettings(listen=flags["--listen"]).check_listen()
    for flag in ("--tls-cert", "--tls-key"):
        mounted = next(m for path, m in mounts(gateway).items() if flags[flag].startswith(path))
        assert "secret" in volumes(pod)[mounted]
    assert port in [p["containerPort"] for p in gateway["ports"]]
    # a driver beside the head's raylet: they share the Ray session directory
    assert mounts(gateway)["/tmp/ray"] == mounts(container(pod, "ray-head"))["/tmp/ray"]
    assert "persistentVolumeClaim" in volumes(pod)[mounts(gateway)[flags["--data-dir"]]]
    [service] = [d for d in documents() if d["kind"] == "Service"]
    assert service["spec"]["ports"][0]["targetPort"] in [p["name"] for p in gateway["ports"]]


def test_every_ray_process_has_token_authentication_on() -> None:
    """KubeRay's authOptions turn Ray's token authentication on with the token of a Secret;
    every container that runs Ray or joins it as a driver (the gateway, beside the head)
    has the mode and that token, so none depends on what the operator version injects."""
    spec = cluster()["spec"]
    assert spec["authOptions"]["mode"] == "token"
    token = {"name": spec["authOptions"]["secretName"], "key": "auth_token"}
    head = spec["headGroupSpec"]
    groups = [head, *spec["workerGroupSpecs"]]
    containers = [c for g in groups for c in g["template"]["spec"]["containers"]]
    assert {c["name"] for c in containers} == {"ray-head", "cella-gateway", "ray-worker"}
    for c in containers:
        env = {e["name"]: e for e in c["env"]}
        assert env["RAY_AUTH_MODE"]["value"] == "token", c["name"]
        assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == token, c["name"]
        assert "CELLA_RAY_ALLOW_UNAUTHENTICATED" not in env, c["name"]
    # and no part of the fleet is told to join a cluster without it
    gateway = container(head["template"], "cella-gateway")
    assert "--ray-allow-unauthenticated" not in gateway["command"]
    for group in spec["workerGroupSpecs"]:
        assert "cella/ray_allow_unauthenticated" not in group.get("labels", {})
