"""Spare QEMUs: started ahead for the warm snapshot, waiting for its state, so a create
that finds the pool empty only loads the state. On a real daemon with real microVMs."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import httpx2
import pytest

from cella import Client
from cella.runtime.qemu.vm import qemu_cmdline
from tests.conftest import qemu_of, qemu_pids
from tests.daemon import Daemon, running_daemon

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def spared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with running_daemon(tmp_path_factory.mktemp("spares"), pool_size="0", pool_spares="1") as d:
        yield d


def qemus_of(d: Daemon) -> set[int]:
    return {p for p in qemu_pids() if f"{d.data_dir}/vms/" in " ".join(qemu_cmdline(p))}


def wait_spare(d: Daemon, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while sum(httpx2.get(f"{d.url}/v1/health").json()["spares"].values()) < 1:
        assert time.monotonic() < deadline, "no spare QEMU came up"
        time.sleep(0.1)


def test_a_create_finishes_the_spare_and_a_new_one_waits(spared: Daemon) -> None:
    with Client(spared.url, spared.admin_key) as client:
        client.create().delete()  # a first create makes the daemon keep its shape warm
        wait_spare(spared)
        waiting = qemus_of(spared)
        assert len(waiting) == 1  # the spare: a QEMU that belongs to no sandbox yet
        sb = client.create()
        try:
            assert sb.events(types=["created"])[0].data["spare"] is True
            assert qemu_of(sb.id) in waiting  # that very process now runs the sandbox
            assert sb.exec("hostname").stdout == f"{sb.id}\n".encode()  # its own identity
            sb.files.write("/root/kept", "x")
            assert sb.files.read("/root/kept") == b"x"
            wait_spare(spared)  # started again for the next create
            (second,) = qemus_of(spared) - {qemu_of(sb.id)}
            other = client.create()
            assert other.events(types=["created"])[0].data["spare"] is True
            assert qemu_of(other.id) == second
            assert other.exec("hostname").stdout == f"{other.id}\n".encode()
            assert not other.files.exists("/root/kept")  # the spare's disk is its own
            other.delete()
        finally:
            sb.delete()


def test_a_spare_left_by_a_killed_daemon_is_cleaned_up(spared: Daemon) -> None:
    wait_spare(spared)
    before = qemus_of(spared)
    assert len(before) == 1  # the spare
    spared.kill9()
    spared.start()
    deadline = time.monotonic() + 30
    while any(os.path.exists(f"/proc/{pid}") for pid in before):
        assert time.monotonic() < deadline, "the old spare's QEMU still runs"
        time.sleep(0.1)
    with Client(spared.url, spared.admin_key) as client, client.create() as sb:
        assert sb.exec("true").exit_code == 0  # and the daemon works on
