"""A real `cella serve` in a subprocess on a loopback port, with its own data directory;
the factories tests get daemons and sandboxes from (fixtures in tests/conftest.py)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx2
import pytest

from cella import Client, Sandbox, errors
from tests.vms import qemu_pids


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
        # unless a test asks: no spare QEMUs and no pool grown past its size (fewer
        # processes idling beside the ones it counts), a refusal at once (no queue for room)
        self.settings = {
            "pool_spares": "0",
            "fork_spares": "0",
            "pool_max_size": "0",
            "admission_wait_seconds": "0",
            **settings,
        }
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

    def client(self, key: str | None = None, **options: Any) -> Client:
        """An SDK client of this daemon: the admin's, or `key`'s (`options` as `Client`
        takes them)."""
        return Client(self.url, key or self.admin_key, **options)

    def env(self, key: str | None = None) -> dict[str, str]:
        return {**os.environ, "CELLA_URL": self.url, "CELLA_API_KEY": key or self.admin_key}


def kill_vms_of(data_dir: object) -> None:
    """VMs outlive their daemon by design; a test daemon's are removed with it."""
    from cella.runtime.qemu.vm import qemu_cmdline

    for pid in qemu_pids():
        if f"{data_dir}/vms/" in " ".join(qemu_cmdline(pid)):
            os.kill(pid, signal.SIGKILL)


def clear_data_of(data_dir: Path) -> None:
    """Everything but the logs goes once a test's daemon has stopped: the suite's disks and
    snapshots add up to more than a shared machine's disk may have free. A directory with
    something still mounted under it is left alone."""
    root = str(data_dir.resolve())
    with open("/proc/self/mounts") as mounts:
        if any(line.split()[1].startswith(root + "/") for line in mounts):
            return
    for entry in data_dir.iterdir() if data_dir.is_dir() else []:
        if entry.suffix == ".log":
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


class DaemonFactory:
    """Starts daemons, each in a data directory of its own, for a test or a module; at the
    end stops every one and kills its VMs (Firecracker's `microvm_factory` is the model)."""

    def __init__(self, tmp: pytest.TempPathFactory) -> None:
        self.tmp = tmp
        self.started: list[Daemon] = []
        self.made: list[Path] = []  # the data directories this factory made (and clears)

    def __call__(
        self,
        name: str = "daemon",
        *,
        data_dir: Path | None = None,
        wrap: list[str] | None = None,
        args: list[str] | None = None,
        timeout: float = 60,
        **settings: str,
    ) -> Daemon:
        """A running daemon: in `data_dir`, else a new directory named after `name`;
        `settings` are its `CELLA_*` settings (lower case, without the prefix)."""
        if data_dir is None:
            data_dir = self.tmp.mktemp(name)
            self.made.append(data_dir)
        daemon = Daemon(data_dir, wrap, args, **settings)
        self.started.append(daemon)  # before it starts: one that hangs is stopped too
        return daemon.start(timeout)

    def __enter__(self) -> DaemonFactory:
        return self

    def __exit__(self, *exc: object) -> None:
        for daemon in reversed(self.started):
            daemon.stop()
            kill_vms_of(daemon.data_dir)
        for data_dir in self.made:
            clear_data_of(data_dir)


class SandboxFactory:
    """Creates sandboxes for a test and deletes every one at the end, whatever the test
    did with them (one it deleted itself is passed over)."""

    def __init__(self) -> None:
        self.made: list[Sandbox] = []

    def __call__(self, client: Client, template: str = "default", **options: Any) -> Sandbox:
        """A running sandbox (`options` as `Client.create` takes them)."""
        sandbox = client.create(template, **options)
        self.made.append(sandbox)
        return sandbox

    def __enter__(self) -> SandboxFactory:
        return self

    def __exit__(self, *exc: object) -> None:
        for sandbox in reversed(self.made):
            with contextlib.suppress(errors.NotFound):
                sandbox.delete()
