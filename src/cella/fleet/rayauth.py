"""Whether a Ray cluster requires its token, asked of the cluster itself.

Ray 2.60 turns token authentication on by itself only for a cluster that `ray.init()`
starts; one started by `ray start` or KubeRay runs without it unless `RAY_AUTH_MODE=token`
is set on every node, and then anyone who reaches its GCS, dashboard or client port runs
code as root on every node. So the gateway, each node daemon and a fleet eval ask the
cluster before they join: a GCS call without a token, from a child process whose Ray has
authentication off (Ray's mode and token are process-wide, and this process may hold the
token). A cluster with authentication on refuses the call; one without answers it.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile

log = logging.getLogger("cella.fleet")
SETTING = "ray_allow_unauthenticated"
TOKEN_VARS = ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ENABLE_K8S_TOKEN_AUTH")
PROBE_TIMEOUT = 90.0  # Ray's client gives up on an unreachable GCS after about 40 s
REQUIRED, OPEN = "token-required", "open"


class UnauthenticatedCluster(RuntimeError):
    """The cluster answers without a token, and the operator did not allow joining it."""


def requires_token(address: str) -> bool:
    """True when the cluster at `address` (a GCS address, or `auto`) refuses a call that
    carries no token; raises ConnectionError when it cannot be asked."""
    with tempfile.TemporaryDirectory(prefix="cella-rayauth-") as home:
        env = {k: v for k, v in os.environ.items() if k not in TOKEN_VARS}
        # no token anywhere the child's Ray looks (its home holds no ~/.ray/auth_token)
        env.update(RAY_AUTH_MODE="disabled", HOME=home)
        try:
            probe = subprocess.run(
                [sys.executable, "-m", "cella.fleet.rayauth", address],
                env=env,
                capture_output=True,
                text=True,
                timeout=PROBE_TIMEOUT,
            )
        except subprocess.TimeoutExpired:
            raise ConnectionError(f"the Ray cluster at {address} did not answer") from None
    answer = probe.stdout.strip().rsplit("\n", 1)[-1]
    if probe.returncode != 0 or answer not in (REQUIRED, OPEN):
        why = probe.stderr.strip().rsplit("\n", 1)[-1]  # the exception, after Ray's warnings
        raise ConnectionError(f"could not ask the Ray cluster at {address}: {why}")
    return answer == REQUIRED


def check(address: str, allow_unauthenticated: bool) -> None:
    """Refuses a cluster that answers without a token, unless the operator allowed it."""
    if requires_token(address):
        return
    if allow_unauthenticated:
        log.warning("the Ray cluster at %s answers without a token (%s is set)", address, SETTING)
        return
    raise UnauthenticatedCluster(
        f"the Ray cluster at {address} answers without a token: anyone who reaches it runs "
        f"code as root on every node. Start every node of it with RAY_AUTH_MODE=token and "
        f"the cluster's token (RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH; docs/kuberay.md), or "
        f"set {SETTING} (`cella serve --ray-allow-unauthenticated`, "
        f"CELLA_{SETTING.upper()}=true, a node's cella/{SETTING} label) to join it anyway"
    )


def _ask(address: str) -> str:
    """The child's side: one call to the GCS without a token."""
    from ray._private.services import canonicalize_bootstrap_address_or_die
    from ray._raylet import GcsClient  # type: ignore[attr-defined]
    from ray.exceptions import AuthenticationError

    gcs = canonicalize_bootstrap_address_or_die(address)  # `auto`: this host's cluster
    try:
        GcsClient(address=gcs).get_all_node_info(timeout=30)
    except AuthenticationError:
        return REQUIRED
    return OPEN


if __name__ == "__main__":
    print(_ask(sys.argv[1]))
