"""kill -9 of the daemon: after a restart every sandbox is in a true state and nothing leaks."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from cella import errors
from cella.runtime.qemu.vm import qemu_cmdline
from tests.daemon import Daemon, DaemonFactory
from tests.vms import qemu_pids

pytestmark = pytest.mark.vm


def vms_of(data_dir: Path) -> set[int]:
    return {p for p in qemu_pids() if f"{data_dir}/vms/" in " ".join(qemu_cmdline(p))}


@pytest.fixture()
def crashy(daemon_factory: DaemonFactory) -> Daemon:
    return daemon_factory("crashy", pool_size="0")


def test_running_sandbox_survives_a_daemon_crash(crashy: Daemon) -> None:
    with crashy.client() as client:
        sb = client.create()
        sb.files.write("/workspace/before.txt", "written before the crash")
        sb.exec("nohup sleep 1000 >/dev/null 2>&1 &")
        pids = vms_of(crashy.data_dir)
        assert len(pids) == 1
    crashy.kill9()
    assert vms_of(crashy.data_dir) == pids  # the VM lives on without its daemon
    crashy.start()
    with crashy.client() as client:
        again = client.get(sb.id)
        assert again.state == "running"  # re-adopted, not rebooted
        assert again.files.read("/workspace/before.txt") == b"written before the crash"
        assert again.exec(["pgrep", "-x", "sleep"]).exit_code == 0  # same processes
        assert vms_of(crashy.data_dir) == pids
        kinds = [e.type for e in again.events()]
        assert "adopted" in kinds
        again.stop()
        again.resume()
        assert again.files.read("/workspace/before.txt") == b"written before the crash"
        again.delete()
    assert vms_of(crashy.data_dir) == set()


def test_sandbox_being_created_is_cleaned_up(crashy: Daemon) -> None:
    failures: list[BaseException] = []

    def create() -> None:
        try:
            with crashy.client() as client:
                client.create(labels={"doomed": "yes"})
        except BaseException as exc:  # the daemon dies under it
            failures.append(exc)

    worker = threading.Thread(target=create)
    worker.start()
    deadline = time.monotonic() + 20
    while not vms_of(crashy.data_dir) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert vms_of(crashy.data_dir), "the create never started a VM"
    crashy.kill9()  # mid-boot: the VM exists, the agent has not answered yet
    worker.join(30)
    assert failures, "the create should have failed with its daemon"
    crashy.start()
    with crashy.client() as client:
        doomed = client.list(labels={"doomed": "yes"})
        assert [s.state for s in doomed] in ([], ["error"])
        errored = client.list(state="error")
        assert all(s.info.error for s in errored)
        for s in errored:
            assert not (crashy.data_dir / "vms" / s.id).exists()  # its overlay was removed
        assert vms_of(crashy.data_dir) == set()  # no stray QEMU
        assert [p.name for p in (crashy.data_dir / "vms").iterdir()] == []
        # the daemon works normally afterwards
        with client.create() as sb:
            assert sb.exec("echo ok").stdout == b"ok\n"


def test_stopped_sandbox_keeps_its_disk_across_a_crash(crashy: Daemon) -> None:
    with crashy.client() as client:
        sb = client.create()
        sb.files.write("/workspace/kept.txt", "kept")
        sb.stop()
    crashy.kill9()
    crashy.start()
    with crashy.client() as client:
        again = client.get(sb.id)
        assert again.state == "stopped"
        assert (crashy.data_dir / "vms" / sb.id / "disk.qcow2").exists()
        again.resume()
        assert again.files.read("/workspace/kept.txt") == b"kept"
        again.delete()
        with pytest.raises(errors.NotFound):
            client.get(sb.id)


def test_paused_sandbox_stays_paused_across_a_crash(crashy: Daemon) -> None:
    with crashy.client() as client:
        sb = client.create()
        sb.exec(
            "nohup sh -c 'while true; do date +%s%N > /tmp/t.new; mv /tmp/t.new /tmp/t; "
            "sleep 0.05; done' >/dev/null 2>&1 &"
        )
        deadline = time.monotonic() + 30
        while not sb.files.exists("/tmp/t"):
            assert time.monotonic() < deadline, "the clock loop never wrote"
            time.sleep(0.05)
        before = sb.files.read("/tmp/t")
        sb.pause()
    crashy.kill9()
    crashy.start()
    with crashy.client() as client:
        again = client.get(sb.id)
        assert again.state == "paused"
        again.resume()
        first = again.files.read("/tmp/t")
        assert first >= before  # memory (and /tmp) kept: not rebooted
        deadline = time.monotonic() + 30
        while again.files.read("/tmp/t") == first:  # the same process runs on
            assert time.monotonic() < deadline, "the clock loop stopped"
            time.sleep(0.05)
        again.delete()


def test_pooled_vms_of_a_crashed_daemon_are_not_leaked(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory("pooled", pool_size="2")
    deadline = time.monotonic() + 120
    while len(vms_of(d.data_dir)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    old = vms_of(d.data_dir)
    assert len(old) == 2
    d.kill9()
    d.start()
    # the old pool's VMs belong to nobody: killed; the new daemon fills a pool of its own
    assert not old & vms_of(d.data_dir)
    live_dirs = {p.name for p in (d.data_dir / "vms").iterdir()}
    with d.client() as client:
        assert client.list() == []
    assert len(live_dirs) <= 2


def test_ttl_is_enforced_by_the_next_daemon_after_a_crash(crashy: Daemon) -> None:
    with crashy.client() as client:
        sb = client.create(ttl_seconds=4, ttl_action="delete")
    crashy.kill9()
    crashy.start()
    with crashy.client() as client:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                client.get(sb.id)
            except errors.NotFound:
                break
            time.sleep(0.2)
        with pytest.raises(errors.NotFound):
            client.get(sb.id)
        assert vms_of(crashy.data_dir) == set()
