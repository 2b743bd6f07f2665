"""mitmproxy in a virtualenv of its own, in the shared image cache.

mitmproxy pins libraries (h11) older than the daemon's HTTP stack needs, so it cannot share
the daemon's environment; it runs as a child process anyway. The cloud signers the addon
uses (botocore for AWS SigV4, google-auth for GCP tokens) live there with it.
"""

from __future__ import annotations

import hashlib
import shutil
import sys
from pathlib import Path

from cella import errors
from cella._proc import Progress, quiet, run
from cella.paths import Paths

MITMPROXY = "mitmproxy==11.0.2"  # the newest release that supports Python 3.11
CLOUD_AUTH = ("botocore==1.44.8", "google-auth==2.63.0")  # network/cloud_auth.py
PACKAGES = (MITMPROXY, *CLOUD_AUTH)
READY = ".ready"


def proxy_env(paths: Paths) -> Path:
    """One directory per package set: a changed set is a new environment beside the old."""
    digest = hashlib.sha256("\n".join(PACKAGES).encode()).hexdigest()[:8]
    return paths.images / "egress" / f"{MITMPROXY.replace('==', '-')}-{digest}"


def mitmdump(paths: Paths) -> Path:
    """The installed mitmdump; ImageMissing if `cella setup` has not installed it."""
    env = proxy_env(paths)
    if not (env / READY).exists():
        raise errors.ImageMissing(
            "the egress proxy (mitmproxy) is not installed: run `cella setup`"
        )
    return env / "bin" / "mitmdump"


def ensure_proxy(paths: Paths, progress: Progress = quiet) -> Path:
    """Installs mitmproxy unless present (virtualenvs are not relocatable: built in place, a
    marker written last says it is complete)."""
    env = proxy_env(paths)
    if (env / READY).exists():
        progress(f"egress proxy: {' '.join(PACKAGES)} present")
        return env / "bin" / "mitmdump"
    shutil.rmtree(env, ignore_errors=True)
    env.parent.mkdir(parents=True, exist_ok=True)
    progress(f"installing the egress proxy ({' '.join(PACKAGES)})")
    base = getattr(sys, "_base_executable", None) or sys.executable
    run([base, "-m", "venv", env], progress=progress)
    run(
        [env / "bin" / "pip", "install", "--quiet", "--disable-pip-version-check", *PACKAGES],
        progress=lambda line: progress(f"  {line}"),
    )
    (env / READY).write_text("\n".join(PACKAGES) + "\n")
    return env / "bin" / "mitmdump"
