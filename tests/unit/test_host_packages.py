"""The host packages' lists as `scripts/bootstrap` reads them (the system's python3, no
virtualenv yet), and `cella setup` waiting for the apt-get bootstrap left running."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from cella.images import host

ROOT = Path(__file__).resolve().parents[2]


def test_the_lists_load_with_the_standard_library_alone() -> None:
    done = subprocess.run(
        [sys.executable, "-S", "-c", "from cella.images import host; print(*host.FIRST_PACKAGES)"],
        env={"PYTHONPATH": str(ROOT / "src")},  # -S: no site-packages, as before the venv
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == list(host.FIRST_PACKAGES)
    assert set(host.FIRST_PACKAGES) <= set(host.HOST_PACKAGES)


def test_setup_waits_for_the_bootstrap_apt_get(monkeypatch: pytest.MonkeyPatch) -> None:
    job = subprocess.Popen(["sh", "-c", "sleep 1", "bootstrap"])  # "bootstrap" in its cmdline
    cmdline = Path(f"/proc/{job.pid}/cmdline")
    while b"bootstrap" not in cmdline.read_bytes():  # until the fork has exec'd sh
        time.sleep(0.01)
    monkeypatch.setenv(host.BOOTSTRAP_APT_PID, str(job.pid))
    told: list[str] = []
    started = time.monotonic()
    assert host._await_bootstrap(told.append)
    assert job.poll() is not None or time.monotonic() - started >= 0.5
    assert told == ["waiting for the host packages scripts/bootstrap is installing"]
    job.wait()
    # the control: another process under that pid (or none) is not waited for
    other = subprocess.Popen(["sleep", "30"])
    try:
        monkeypatch.setenv(host.BOOTSTRAP_APT_PID, str(other.pid))
        told.clear()
        assert not host._await_bootstrap(told.append)
        assert told == [] and other.poll() is None
    finally:
        other.kill()
        other.wait()
