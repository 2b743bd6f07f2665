from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest

from cella import Client
from cella.runtime.qemu.vm import qemu_cmdline
from tests.conftest import qemu_pids
from tests.daemon import Daemon


def kill_vms_of(data_dir: object) -> None:
    """VMs outlive their daemon by design; a test daemon's are removed with it."""
    for pid in qemu_pids():
        if f"{data_dir}/vms/" in " ".join(qemu_cmdline(pid)):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    # no warm pool here: fewer VMs idling in the background (the pool has its own tests)
    d = Daemon(tmp_path_factory.mktemp("daemon"), max_upload_mib="8", pool_size="0").start()
    yield d
    d.stop()
    kill_vms_of(d.data_dir)


@pytest.fixture(scope="module")
def admin(daemon: Daemon) -> Iterator[Client]:
    with Client(daemon.url, daemon.admin_key) as client:
        yield client
