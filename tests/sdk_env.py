"""A foreign SDK, pinned, in a virtual environment of its own (made once, then reused), and
scripts run with it against a real daemon: the SDK's own dependencies never meet cella's."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(os.environ.get("CELLA_TEST_VENVS", "/var/tmp/cella-test-venvs"))


def sdk_python(name: str, requirements: list[str]) -> Path:
    """The interpreter of a venv holding exactly these requirements."""
    where = ROOT / name
    marker = where / ".requirements"
    wanted = "\n".join(requirements)
    ROOT.mkdir(parents=True, exist_ok=True)
    with open(ROOT / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (marker.exists() and marker.read_text() == wanted):
            subprocess.run(["rm", "-rf", str(where)], check=True)
            subprocess.run([sys.executable, "-m", "venv", str(where)], check=True)
            pip = [str(where / "bin" / "python"), "-m", "pip", "install", "-q"]
            subprocess.run([*pip, "--upgrade", "pip"], check=True)
            subprocess.run([*pip, *requirements], check=True)
            marker.write_text(wanted)
    return where / "bin" / "python"


# Once a script has run to its end, it leaves without the interpreter's teardown: the e2b
# SDK's native HTTP transport now and then aborts there (SIGABRT, no message) after its
# sandboxes are gone, which says nothing about what the script checked. A script that
# fails before its end still fails with its own status and traceback.
LEAVE = "\nimport os as _os, sys as _sys\n_sys.stdout.flush()\n_sys.stderr.flush()\n_os._exit(0)\n"


def run_script(python: Path, script: str, env: dict[str, str], timeout: float = 300) -> Any:
    """Runs `script`; its last line of output is JSON, returned parsed."""
    done = subprocess.run(
        [str(python), "-c", script + LEAVE],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if done.returncode != 0:
        raise AssertionError(
            f"the script failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
        )
    return json.loads(done.stdout.strip().splitlines()[-1])
