"""A fleet on a real Ray cluster: a head, three nodes that run sandboxes, and a gateway.

These tests run inside a loopback-only network namespace (`tests/integration/test_fleet.py`
runs them there); they refuse to run anywhere else, because Ray binds and probes more than
loopback when it can.
"""

from __future__ import annotations

import json
import os
import socket
import ssl
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx2
import pytest

from tests.daemon import Daemon, clear_data_of, kill_vms_of
from tests.fleet.outside import Outside
from tests.raycluster import LocalCluster, quiet_ray_env

NODES = ("n1", "n2", "n3")
NODE_SETTINGS = {"pool_size": "0", "pool_spares": "0", "max_host_memory_mib": "768"}  # 3 of 256 MiB
SHAPE = {"memory_mib": 256}
QUOTA = 5  # the gateway's limit of live sandboxes per tenant, across nodes
REPLICA_INTERVAL = 5  # seconds between refreshes of a running replicated sandbox's replica
REPLICATING = "replicating"  # a tenant whose every sandbox is replicated


@pytest.fixture(autouse=True, scope="session")
def loopback_only() -> None:
    if [name for _, name in socket.if_nameindex()] != ["lo"]:
        pytest.skip("run by tests/integration/test_fleet.py, in a loopback-only namespace")


@dataclass
class Fleet:
    cluster: LocalCluster
    gateway: Daemon
    node_root: Path
    admin: httpx2.Client = field(init=False)

    def __post_init__(self) -> None:
        self.admin = self.client(self.gateway.admin_key)

    def client(self, key: str) -> httpx2.Client:
        return httpx2.Client(
            base_url=self.gateway.url,
            headers={"authorization": f"Bearer {key}"},
            timeout=httpx2.Timeout(120.0),
            verify=self.gateway.tls or True,
        )

    def serve_tls(self, cert: Path, key: Path) -> None:
        """The gateway restarted serving TLS with `cert` (clients made before still speak
        plain HTTP to it: only the last checks call this)."""
        self.gateway.stop()
        self.gateway.settings |= {"tls_cert": str(cert), "tls_key": str(key)}
        self.gateway.tls = ssl.create_default_context(cafile=str(cert))
        self.gateway.url = self.gateway.url.replace("http://", "https://")
        self.gateway.start(timeout=120)
        self.admin.close()
        self.admin = self.client(self.gateway.admin_key)

    def node_of(self, sandbox_id: str) -> str:
        """The node whose data directory holds the sandbox's VM."""
        held = [n for n in os.listdir(self.node_root) if (self.vm_dir(n, sandbox_id)).exists()]
        assert len(held) == 1, f"{sandbox_id} is on {held}"
        return held[0]

    def vm_dir(self, node: str, sandbox_id: str) -> Path:
        return self.node_root / node / "vms" / sandbox_id

    def snapshot_dir(self, node: str, snapshot_id: str) -> Path:
        return self.node_root / node / "snapshots" / snapshot_id

    def restart_gateway(self) -> None:
        self.gateway.stop()
        self.gateway.start(timeout=120)


@pytest.fixture(scope="session")
def outside(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Outside]:
    """Servers the sandboxes of the fleet reach by name (the nodes are told them, and the
    registries' CA, through the environment every node daemon inherits)."""
    with Outside.started(tmp_path_factory.mktemp("outside")) as found:
        os.environ["CELLA_EGRESS_HOSTS"] = json.dumps(found.hosts)
        os.environ["CELLA_EXTRA_CA_CERTIFICATES"] = json.dumps([str(found.ca_cert)])
        os.environ["CELLA_EGRESS_UPSTREAM_CA"] = str(found.ca_cert)  # TLS the proxy opens
        yield found


@pytest.fixture(scope="session")
def fleet(outside: Outside) -> Iterator[Fleet]:
    quiet_ray_env()
    root = Path(tempfile.mkdtemp(prefix="cella-fleet-"))
    cluster = LocalCluster()
    gateway = None
    try:
        for name in NODES:
            cluster.add(name, **NODE_SETTINGS)
        gateway = Daemon(
            root / "gateway",
            args=["--ray", cluster.address, "--node-root", str(root / "nodes")],
            max_sandboxes_per_tenant=str(QUOTA),
            replica_interval_s=str(REPLICA_INTERVAL),
            replicate_tenants=json.dumps([REPLICATING]),
        ).start(timeout=240)
        yield Fleet(cluster, gateway, root / "nodes")
    finally:
        if gateway is not None:
            gateway.stop()
        cluster.shutdown()
        time.sleep(0.5)
        for name in os.listdir(root / "nodes") if (root / "nodes").exists() else []:
            kill_vms_of(root / "nodes" / name)
        for data_dir in [root / "gateway", *(root / "nodes").glob("*")]:
            clear_data_of(data_dir)  # the nodes' disks and snapshots; their logs stay


@pytest.fixture(scope="session")
def tenant(fleet: Fleet) -> Iterator[httpx2.Client]:
    key = fleet.admin.post("/v1/keys", json={"tenant": "acme"}).json()["key"]
    with fleet.client(key) as client:
        yield client
