"""`cella setup --service`: the daemon as a systemd service.

The unit restarts the daemon when it fails and leaves its VMs alone when it stops or restarts
(`KillMode=process`: each VM's QEMU outlives the daemon, and the next one adopts it), gives it
its own cgroup subtree to put VMs in (`Delegate=yes`), and logs JSON lines to the journal."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

UNIT_PATH = Path("/etc/systemd/system/cella.service")


def unit_text(cella: Path, data_dir: Path, listen: str) -> str:
    command = shlex.join(
        [
            str(cella),
            "serve",
            "--listen",
            listen,
            "--data-dir",
            str(data_dir),
            "--log-format",
            "json",
        ]
    )
    return f"""[Unit]
Description=cella: microVM sandboxes for AI coding agents
After=network-online.target
Wants=network-online.target

[Service]
Type=exec
ExecStart={command}
Restart=on-failure
RestartSec=2s
# the VMs outlive a stop or restart of the daemon: the next daemon adopts them
KillMode=process
# the daemon puts each VM in a cgroup of its own under this one
Delegate=yes
LimitNOFILE=1048576
TasksMax=infinity
StateDirectory=cella
Environment=PYTHONUNBUFFERED=1

[Install]
WantedBy=multi-user.target
"""


def verify(path: Path) -> str:
    """`systemd-analyze verify`'s complaints about the unit at `path` ("" when none)."""
    done = subprocess.run(
        ["systemd-analyze", "verify", str(path)], capture_output=True, text=True, check=False
    )
    lines = (done.stdout + done.stderr).splitlines()
    problems = [line for line in lines if line.startswith(f"{path.name}:") or str(path) in line]
    if done.returncode and not problems:
        problems = lines or [f"systemd-analyze verify exited with {done.returncode}"]
    return "\n".join(problems)


def install(data_dir: Path, listen: str, path: Path = UNIT_PATH) -> Path:
    """Writes the unit (verified first), reloads systemd and enables the service."""
    cella = Path(sys.argv[0]).resolve() if Path(sys.argv[0]).name == "cella" else None
    cella = cella or Path(sys.executable).with_name("cella")
    with tempfile.TemporaryDirectory() as tmp:
        staged = Path(tmp) / path.name
        staged.write_text(unit_text(cella, data_dir, listen))
        if problems := verify(staged):
            raise RuntimeError(f"the unit does not verify:\n{problems}")
        shutil.copyfile(staged, path)
    subprocess.run(["systemctl", "daemon-reload"], check=False)
    subprocess.run(["systemctl", "enable", path.name], check=False)
    return path
