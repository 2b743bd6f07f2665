"""Spare QEMUs: started ahead for the warm snapshot, waiting for its state, so a create
that finds the pool empty only loads the state. On a real daemon with real microVMs."""

from __future__ import annotations

import os
import time

import httpx2
import pytest

from cella import Client
from cella.runtime.qemu.vm import qemu_cmdline
from tests.daemon import Daemon, SandboxFactory
from tests.vms import qemu_of, qemu_pids

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def daemon_settings() -> dict[str, str]:
    return {"pool_size": "0", "pool_spares": "1"}


def qemus_of(d: Daemon) -> set[int]:
    return {p for p in qemu_pids() if f"{d.data_dir}/vms/" in " ".join(qemu_cmdline(p))}


def wait_spare(d: Daemon, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while sum(httpx2.get(f"{d.url}/v1/health").json()["spares"].values()) < 1:
        assert time.monotonic() < deadline, "no spare QEMU came up"
        time.sleep(0.1)


def test_a_create_finishes_the_spare_and_a_new_one_waits(
    daemon: Daemon, admin: Client, sandbox_factory: SandboxFactory
) -> None:
    admin.create().delete()  # a first create makes the daemon keep its shape warm
    wait_spare(daemon)
    waiting = qemus_of(daemon)
    assert len(waiting) == 1  # the spare: a QEMU that belongs to no sandbox yet
    sb = sandbox_factory(admin)
    assert sb.events(types=["created"])[0].data["spare"] is True
    assert qemu_of(sb.id) in waiting  # that very process now runs the sandbox
    assert sb.exec("hostname").stdout == f"{sb.id}\n".encode()  # its own identity
    sb.files.write("/root/kept", "x")
    assert sb.files.read("/root/kept") == b"x"
    wait_spare(daemon)  # started again for the next create
    (second,) = qemus_of(daemon) - {qemu_of(sb.id)}
    other = admin.create()
    assert other.events(types=["created"])[0].data["spare"] is True
    assert qemu_of(other.id) == second
    assert other.exec("hostname").stdout == f"{other.id}\n".encode()
    assert not other.files.exists("/root/kept")  # the spare's disk is its own
    other.delete()


def test_a_spare_left_by_a_killed_daemon_is_cleaned_up(daemon: Daemon) -> None:
    wait_spare(daemon)
    before = qemus_of(daemon)
    assert len(before) == 1  # the spare
    daemon.kill9()
    daemon.start()
    deadline = time.monotonic() + 30
    while any(os.path.exists(f"/proc/{pid}") for pid in before):
        assert time.monotonic() < deadline, "the old spare's QEMU still runs"
        time.sleep(0.1)
    with daemon.client() as client, client.create() as sb:
        assert sb.exec("true").exit_code == 0  # and the daemon works on
