"""A Ray cluster of several nodes on this one machine, for fleet tests and benches.

Every node is pinned to 127.0.0.1 and the cluster is meant to run inside a loopback-only
network namespace (`tests/integration/test_fleet.py` makes one); Ray's usage report and
cloud-metadata probes are turned off so nothing tries to leave the machine. The cluster
runs with Ray's token authentication on, as a fleet must; `open_cluster` runs one without
it, as Ray leaves a cluster it did not start itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Ray's phone-home and cloud probes: off before ray is imported anywhere
QUIET_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_USAGE_STATS_REPORT_URL": "http://127.0.0.1:9/",
    "RAY_DEDUP_LOGS": "0",
    "RAY_BACKEND_LOG_LEVEL": "warning",
}
# dead nodes noticed in about a second, not fifteen
HEALTH = {
    "health_check_initial_delay_ms": 1000,
    "health_check_period_ms": 500,
    "health_check_timeout_ms": 500,
    "health_check_failure_threshold": 3,
}
STORE = 80 << 20  # Ray's minimum object store is 75 MiB
TOKEN_VARS = ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ENABLE_K8S_TOKEN_AUTH")
ROOT = Path(__file__).resolve().parents[1]


def quiet_ray_env() -> None:
    """Sets the environment the cluster, its workers and the gateway inherit. HOME holds an
    empty `ray_bootstrap_config.yaml`, which makes Ray skip its cloud-metadata probes."""
    home = Path(tempfile.mkdtemp(prefix="cella-rayhome-"))
    (home / "ray_bootstrap_config.yaml").write_text("{}\n")
    os.environ.update(QUIET_ENV)
    os.environ["HOME"] = str(home)
    # token authentication on, with a token of this run's own, for every Ray process
    # started from here on (the cluster's, its workers', the gateway's, the drivers')
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)


def without_token(env: dict[str, str]) -> dict[str, str]:
    """`env` for a Ray process with token authentication off and no token to send."""
    kept = {k: v for k, v in env.items() if k not in TOKEN_VARS}
    return {**kept, "RAY_AUTH_MODE": "disabled"}


class LocalCluster:
    def __init__(self) -> None:
        from ray.cluster_utils import Cluster

        self.temp = tempfile.mkdtemp(prefix="crt-", dir="/tmp")  # AF_UNIX paths stay short
        os.makedirs("/tmp/ray", exist_ok=True)  # Ray notes the current cluster's address there
        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 0,
                "include_dashboard": False,
                "node_ip_address": "127.0.0.1",
                "object_store_memory": STORE,
                "temp_dir": self.temp,
                "_system_config": HEALTH,
            },
        )
        self.nodes: dict[str, Any] = {}

    @property
    def address(self) -> str:
        return str(self.cluster.address)

    def add(self, name: str, **settings: str) -> Any:
        """A node that runs sandboxes: the `cella_node` resource, named by its label, with
        daemon settings as `cella/<setting>` labels."""
        labels = {"cella/node-name": name, **{f"cella/{k}": v for k, v in settings.items()}}
        node = self.cluster.add_node(
            num_cpus=1,
            resources={"cella_node": 1},
            labels=labels,
            node_ip_address="127.0.0.1",
            object_store_memory=STORE,
        )
        self.nodes[name] = node
        self.cluster.wait_for_nodes()
        return node

    def kill(self, name: str) -> None:
        """The node dies: its raylet and everything under it are SIGKILLed."""
        self.cluster.remove_node(self.nodes.pop(name), allow_graceful=False)

    def shutdown(self) -> None:
        import ray

        if ray.is_initialized():  # a driver in this process (an eval) must go first
            ray.shutdown()
        self.cluster.shutdown()


@contextlib.contextmanager
def open_cluster(nodes: dict[str, dict[str, str]]) -> Iterator[str]:
    """A second cluster, with token authentication off, of the named sandbox nodes (their
    settings as labels), run by a child process; yields its address."""
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.raycluster", json.dumps(nodes)],
        cwd=ROOT,
        env=without_token(dict(os.environ)),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        lines = (line.strip() for line in child.stdout)
        address = next((ln.split("=", 1)[1] for ln in lines if ln.startswith("address=")), "")
        if not address:
            raise RuntimeError(f"the open cluster did not start (exit {child.wait(60)})")
        yield address
    finally:
        child.stdin.close()  # the child shuts its cluster down at the end of its input
        try:
            child.wait(120)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def _serve_cluster(nodes: dict[str, dict[str, str]]) -> None:
    """`open_cluster`'s child: the cluster lives until standard input ends."""
    cluster = LocalCluster()
    try:
        for name, settings in nodes.items():
            cluster.add(name, **settings)
        print(f"address={cluster.address}", flush=True)
        sys.stdin.read()
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    _serve_cluster(json.loads(sys.argv[1]))


class AutoscalingCluster:
    """A head whose autoscaler launches and removes sandbox nodes on this machine (Ray's
    `fake_multinode` provider: each node a raylet of its own, started by the autoscaler's
    monitor). Started by `ray start --head --block` in a session of its own, and stopped by
    ending that session and every process of this cluster's temp directory (never
    `ray stop`, which ends every Ray process on the machine)."""

    def __init__(self, node_type: dict[str, Any], idle_timeout_s: float) -> None:
        self.temp = tempfile.mkdtemp(prefix="cas-", dir="/tmp")
        self.port = _free_port()
        self.config = Path(self.temp) / "autoscaling.json"
        self.config.write_text(json.dumps(self._config(node_type, idle_timeout_s)))
        self.head: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def _gcs(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)

    def _config(self, node_type: dict[str, Any], idle_timeout_s: float) -> dict[str, Any]:
        return {
            "cluster_name": "cella-autoscale",
            "max_workers": node_type["max_workers"],
            "upscaling_speed": 1.0,
            "idle_timeout_minutes": idle_timeout_s / 60,
            "provider": {
                "type": "fake_multinode",
                "use_node_id_as_ip": True,  # every node is 127.0.0.1 here
                "disable_node_updaters": True,
                "disable_launch_config_check": True,
                "gcs_address": self.address,
            },
            "available_node_types": {
                "ray.head.default": {"resources": {}, "node_config": {}, "max_workers": 0},
                "sandbox": {"node_config": {}, **node_type},
            },
            "head_node_type": "ray.head.default",
            "auth": {"ssh_user": "nobody"},
            "docker": {},
            "file_mounts": {},
            "cluster_synced_files": [],
            "file_mounts_sync_continuously": False,
            "rsync_exclude": [],
            "rsync_filter": [],
            "initialization_commands": [],
            "setup_commands": [],
            "head_setup_commands": [],
            "worker_setup_commands": [],
            "head_start_ray_commands": [],
            "worker_start_ray_commands": [],
        }

    def start(self) -> AutoscalingCluster:
        env = {**os.environ, "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"}
        log = (Path(self.temp) / "head.log").open("ab")
        self.head = subprocess.Popen(
            [
                str(Path(sys.executable).parent / "ray"),
                "start",
                "--head",
                "--block",
                f"--port={self.port}",
                "--node-ip-address=127.0.0.1",
                "--num-cpus=0",
                f"--object-store-memory={STORE}",
                "--include-dashboard=false",
                f"--temp-dir={self.temp}",
                f"--autoscaling-config={self.config}",
                f"--system-config={json.dumps(HEALTH, separators=(',', ':'))}",
            ],
            env=env,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
        deadline = time.monotonic() + 60
        while True:  # the GCS answers: drivers may join
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), 1),
            ):
                return self
            if self.head.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the head did not start: see {self.temp}/head.log")
            time.sleep(0.2)

    def shutdown(self) -> None:
        import psutil

        if self.head is not None:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.head.pid, sig)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.head.wait(5)
                    break
        # the nodes the autoscaler started live in its monitor's process tree or were left
        # to init: found by this cluster's own temp directory on their command lines
        for proc in psutil.process_iter(["pid", "cmdline"]):
            with contextlib.suppress(psutil.Error):
                if any(self.temp in part for part in proc.info["cmdline"] or []):
                    proc.kill()
        shutil.rmtree(self.temp, ignore_errors=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
