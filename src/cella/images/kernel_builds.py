"""cella's own kernel, compiled in the background while a stock kernel serves.

`cella setup` on a host without the tuned kernel starts `cella setup --kernel tuned
--kernel-only` as a process of its own (niced, in its own session, so it outlives the set-up
and the terminal) and goes on at once with the stock kernel. A daemon switches to the tuned
kernel when it appears (`Driver.refresh_boot`); `/v1/health` says which kernel serves and
whether a better one is coming.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from cella.images.kernel import Kernel, tuned_is_current
from cella.paths import Paths

LOG = "kernel-build.log"
PID = "kernel-build.pid"


def log_file(paths: Paths) -> Path:
    return paths.images / LOG


def running_pid(paths: Paths) -> int | None:
    """The background build's pid while it runs."""
    try:
        pid = int((paths.images / PID).read_text())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return None
    return pid if b"--kernel-only" in cmdline else None  # not a reused pid


def start(paths: Paths) -> int:
    """Starts the build unless one runs; returns its pid."""
    if (pid := running_pid(paths)) is not None:
        return pid
    paths.ensure()
    with log_file(paths).open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cella.cli", "setup", "--kernel", "tuned", "--kernel-only"],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # survives the set-up and its terminal
            preexec_fn=lambda: os.nice(19),  # sandboxes first: it only has to finish some time
            env={
                **os.environ,
                "CELLA_DATA_DIR": str(paths.root),
                "CELLA_IMAGE_DIR": str(paths.images),
            },
        )
    (paths.images / PID).write_text(str(proc.pid))
    return proc.pid


def upgrade_status(paths: Paths, serving: Kernel) -> str | None:
    """`None` when the best kernel serves; else `building`, `ready` (the daemon switches
    within seconds) or `failed` (see the log; `cella setup --kernel tuned` tries again)."""
    if serving.kind == "tuned":
        return None
    if tuned_is_current(paths):
        return "ready"
    if running_pid(paths) is not None:
        return "building"
    return "failed" if log_file(paths).exists() else None
