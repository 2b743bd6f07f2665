"""The node daemon of one Ray node: a detached Ray actor pinned to the node that runs
`cella serve` there and keeps it running.

The daemon is the unit of a node (its own data directory, SQLite, warm pool and egress
proxy); its VMs are its children, not Ray workers, so a sandbox costs no Ray process. The
daemon dies with the actor's worker (`setpriv --pdeathsig KILL`, started from the one thread
that lives as long as the actor), and the actor, restarted by Ray, starts it again on the
same data directory, where recovery picks up what the last one left.

Node settings come from the node's Ray labels: `cella/node-name` names the node (and its
data directory; Ray's NodeID changes when a raylet restarts; `cella/node-group` names the
nodes of an autoscaler's node type, see `node_name`), and `cella/<setting>` sets a
daemon setting (e.g. `cella/pool_size: "0"`, see `cella.config`). The daemon speaks TLS
only, with a certificate of its own for the node's address (`cella.fleet.tls`). It runs
only on a cluster that requires Ray's token (`cella.fleet.rayauth`), unless the node's
`cella/ray_allow_unauthenticated` label says otherwise, and never holds that token.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx2
import ray
from pydantic import TypeAdapter

from cella.fleet import rayauth
from cella.fleet.tls import node_certificate, trusting

NAMESPACE = "cella"
RESOURCE = "cella_node"  # the custom resource marking a Ray node that runs sandboxes
NAME_LABEL = "cella/node-name"
SETTING_PREFIX = "cella/"
START_TIMEOUT = 180.0


GROUP_LABEL = "cella/node-group"  # an autoscaler's node type: its nodes share their labels


def node_name(node_id: str, labels: dict[str, str]) -> str:
    """The node's label names it; a node of an autoscaled group (whose nodes share one set of
    labels) is named by its group and the end of its Ray NodeID (the start of a simulated
    node's ID is the same for every node)."""
    if NAME_LABEL in labels:
        return labels[NAME_LABEL]
    if GROUP_LABEL in labels:
        return f"{labels[GROUP_LABEL]}-{node_id[-12:]}"
    return f"node-{node_id[:12]}"


def actor_name(node_id: str) -> str:
    return f"cella-node-{node_id}"


def daemon_env(labels: dict[str, str]) -> dict[str, str]:
    """CELLA_* variables from the node's `cella/<setting>` labels."""
    env = {}
    for key, value in labels.items():
        if key.startswith(SETTING_PREFIX) and key not in (NAME_LABEL, GROUP_LABEL):
            setting = key[len(SETTING_PREFIX) :].replace("-", "_").upper()
            env[f"CELLA_{setting}"] = value
    return env


def allows_unauthenticated(env: dict[str, str]) -> bool:
    """The node's `ray_allow_unauthenticated` setting: its label, else its environment."""
    value = env.get(f"CELLA_{rayauth.SETTING.upper()}", "false")
    return TypeAdapter(bool).validate_python(value)


@ray.remote(num_cpus=0, max_concurrency=8, max_restarts=-1)  # type: ignore[call-overload]
class NodeDaemon:
    def __init__(self, data_root: str, name: str, labels: dict[str, str]) -> None:
        context = ray.get_runtime_context()
        self.env = {**os.environ, **daemon_env(labels)}
        # no daemon on a cluster that answers without a token, unless this node allows it
        rayauth.check(context.gcs_address, allows_unauthenticated(self.env))
        # nor does the daemon (or any process of its VMs) hold the cluster's token
        for var in ("CELLA_URL", "CELLA_API_KEY", "CELLA_DATA_DIR", *rayauth.TOKEN_VARS):
            self.env.pop(var, None)
        self.node_id = context.get_node_id()
        self.name = name
        self.ip: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        self.data_dir = Path(data_root) / name
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.ca_pem = ""  # the daemon's own certificate: what its clients trust
        self.restarts = -1
        self._up = threading.Event()
        self._failure = ""
        threading.Thread(target=self._supervise, name="cella-node", daemon=True).start()
        if not self._up.wait(START_TIMEOUT):
            raise RuntimeError(f"the cella daemon of {name} did not start: {self._failure}")

    def _supervise(self) -> None:
        """Starts the daemon and starts it again whenever it exits (on this thread, which
        lives as long as the actor: the daemon's death signal is tied to it)."""
        while True:
            try:
                self._start()
                self._up.set()
            except Exception as exc:
                self._failure = f"{type(exc).__name__}: {exc}"
                time.sleep(1)
                continue
            assert self.proc is not None
            self.proc.wait()
            self._failure = f"the daemon exited with {self.proc.returncode}"

    def _start(self) -> None:
        self._kill_stale()
        port = self._port()
        cert, key = node_certificate(self.data_dir / "tls", self.ip, self.name)
        self.ca_pem = cert.read_text()
        log = (self.data_dir / "daemon.log").open("ab")
        self.proc = subprocess.Popen(
            [
                "setpriv",
                "--pdeathsig",
                "KILL",
                "--",
                sys.executable,
                "-m",
                "cella.cli",
                "serve",
                "--listen",
                f"{self.ip}:{port}",
                "--data-dir",
                str(self.data_dir),
                "--tls-cert",
                str(cert),
                "--tls-key",
                str(key),
            ],
            env=self.env,
            stdout=log,
            stderr=log,
        )
        (self.data_dir / "node.pid").write_text(str(self.proc.pid))
        self.restarts += 1
        url = f"https://{self.ip}:{port}"
        trusted = trusting(self.ca_pem)
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the daemon exited with {self.proc.returncode}")
            with contextlib.suppress(httpx2.HTTPError):
                health = httpx2.get(f"{url}/v1/health", timeout=2, verify=trusted)
                if health.status_code == 200:
                    self.url = url
                    return
            time.sleep(0.1)
        self.proc.kill()
        raise RuntimeError("the daemon did not answer in time")

    def _port(self) -> int:
        """The port the node's daemon had before, if it is free (its URL stays the same
        across restarts), else a new one."""
        saved = self.data_dir / "node.port"
        with contextlib.suppress(OSError, ValueError):
            port = int(saved.read_text())
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((self.ip, port))
            return port
        port = _free_port(self.ip)
        saved.write_text(str(port))
        return port

    def _kill_stale(self) -> None:
        """A daemon an earlier incarnation left (should its death signal have missed)."""
        pidfile = self.data_dir / "node.pid"
        with contextlib.suppress(OSError, ValueError):
            pid = int(pidfile.read_text())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if str(self.data_dir).encode() in cmdline and b"serve" in cmdline:
                os.kill(pid, signal.SIGKILL)

    def info(self) -> dict[str, Any]:
        alive = self.proc is not None and self.proc.poll() is None and bool(self.url)
        key_file = self.data_dir / "admin.key"
        return {
            "name": self.name,
            "node_id": self.node_id,
            "url": self.url,
            "ca_pem": self.ca_pem,
            "admin_key": key_file.read_text().strip() if key_file.exists() else "",
            "alive": alive,
            "pid": self.proc.pid if self.proc else None,
            "restarts": self.restarts,
            "reason": None if alive else self._failure,
        }


def _free_port(ip: str) -> int:
    with socket.socket() as s:
        s.bind((ip, 0))
        return int(s.getsockname()[1])
