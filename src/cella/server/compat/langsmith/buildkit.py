"""`create_snapshot_from_dockerfile`: the SDK starts a builder sandbox and runs BuildKit
there (`buildkitd`, `buildctl`, `buildkit-runc`, then `docker load`). When the SDK's build
script arrives, the sandbox is asked whether it has those tools; if it does, the script runs
unchanged, and if not the caller is told which are missing rather than left with a failed
build. None of the package registries cella's images are made from (Debian 12, PyPI, npm)
has BuildKit, so cella's own templates do not."""

from __future__ import annotations

import re

from cella import errors
from cella.models import ExecRequest
from cella.server.compat.langsmith.shapes import not_supported
from cella.service.daemon import Daemon
from cella.service.keys import Principal

TOOLS = ("buildkitd", "buildctl", "buildkit-runc", "docker")
# the head of the SDK's script (langsmith.sandbox._client._make_dockerfile_build_command)
SDK_BUILD = re.compile(r"set -euo pipefail\nmkdir -p [^\n]*\nbuildkitd --addr ")
PROBE = 'for t in "$@"; do command -v "$t" >/dev/null 2>&1 || echo "$t"; done'


async def check(svc: Daemon, who: Principal, sandbox_id: str, command: str) -> None:
    """Refuses the SDK's Dockerfile build, naming what is missing, in a sandbox without
    BuildKit; anything else passes untouched."""
    if not SDK_BUILD.match(command):
        return
    probe = ExecRequest(command=["sh", "-c", PROBE, "probe", *TOOLS], timeout=30)
    try:
        result = await svc.exec.run(who, sandbox_id, probe, exempt=True)
    except errors.CellaError:
        return  # the command itself will meet (and report) what stopped the probe
    missing = result.stdout.decode(errors="replace").split()
    if missing:
        raise not_supported(
            "building a snapshot from a Dockerfile with BuildKit "
            f"(create_snapshot_from_dockerfile): the sandbox has no {', '.join(missing)}. "
            "No package registry cella's images come from (Debian 12, PyPI, npm) has BuildKit. "
            "Instead: `docker build` in a sandbox of the `docker` template, then "
            "capture_snapshot(..., docker_image=...); or `cella template build --dockerfile`"
        )
