"""A real `cella serve` in a subprocess on a loopback port, with its own data directory."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Daemon:
    def __init__(
        self,
        data_dir: Path,
        wrap: list[str] | None = None,
        args: list[str] | None = None,
        **settings: str,
    ) -> None:
        self.data_dir = data_dir
        self.wrap = wrap or []  # a command the daemon runs under (e.g. in its own namespace)
        self.args = args or []  # more `cella serve` flags (e.g. --ray for a fleet gateway)
        self.port = free_port()
        self.tls = (
            ssl.create_default_context(cafile=settings["tls_cert"])
            if "tls_cert" in settings
            else None
        )
        self.url = f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"
        # no spare QEMUs unless a test asks: fewer processes idling beside the ones it counts
        self.settings = {"pool_spares": "0", **settings}
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = data_dir / "daemon.log"

    def start(self, timeout: float = 60) -> Daemon:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **{f"CELLA_{k.upper()}": v for k, v in self.settings.items()}}
        env.pop("CELLA_URL", None)
        env.pop("CELLA_API_KEY", None)
        log = self.log.open("ab")
        self.proc = subprocess.Popen(
            [
                *self.wrap,
                sys.executable,
                "-m",
                "cella.cli",
                "serve",
                "--listen",
                f"127.0.0.1:{self.port}",
                "--data-dir",
                str(self.data_dir),
                *self.args,
            ],
            env=env,
            stdout=log,
            stderr=log,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited: {self.log.read_text()[-3000:]}")
            try:
                health = httpx2.get(f"{self.url}/v1/health", timeout=1, verify=self.tls or True)
                if health.status_code == 200:
                    return self
            except httpx2.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"daemon did not start: {self.log.read_text()[-3000:]}")

    @property
    def admin_key(self) -> str:
        return (self.data_dir / "admin.key").read_text().strip()

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def env(self, key: str | None = None) -> dict[str, str]:
        return {**os.environ, "CELLA_URL": self.url, "CELLA_API_KEY": key or self.admin_key}


def kill_vms_of(data_dir: object) -> None:
    """VMs outlive their daemon by design; a test daemon's are removed with it."""
    from cella.runtime.qemu.vm import qemu_cmdline
    from tests.conftest import qemu_pids

    for pid in qemu_pids():
        if f"{data_dir}/vms/" in " ".join(qemu_cmdline(pid)):
            os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def running_daemon(
    data_dir: Path, wrap: list[str] | None = None, **settings: str
) -> Iterator[Daemon]:
    """A daemon for the duration of the block; stopped, and its VMs killed, afterwards."""
    d = Daemon(data_dir, wrap, **settings).start()
    try:
        yield d
    finally:
        d.stop()
        kill_vms_of(d.data_dir)
