"""Every QEMU in its own jail: checked on the processes of a real daemon's sandboxes, and by
helpers that enter a QEMU's jail (its mount, IPC, UTS and network namespaces, as its uid
with its groups, no capabilities) to try what an escaped QEMU would. Each refusal has a
control: the same helper, the same way, reaching what the jail does hold."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from cella import Client, Sandbox
from cella.paths import Paths
from cella.runtime.qemu.driver import QemuDriver
from cella.runtime.qemu.jail import JailIds
from tests.daemon import Daemon
from tests.vms import VMFactory, qemu_of

pytestmark = [pytest.mark.vm, pytest.mark.hardening]
JAIL_BASE = 3_000_000


@pytest.fixture(scope="module")
def daemon_settings() -> dict[str, str]:
    return {"pool_size": "1"}


@pytest.fixture(scope="module")
def pair(admin: Client) -> Iterator[tuple[Sandbox, Sandbox]]:
    a, b = admin.create(), admin.create()
    a.files.write("/root/mine.txt", b"a's own")
    yield a, b
    a.delete()
    b.delete()


def status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: v.strip() for k, _, v in (line.partition(":") for line in lines)}


def in_jail(pid: int, *argv: str) -> subprocess.CompletedProcess[str]:
    """`argv` inside QEMU `pid`'s jail: its namespaces, its uid, gid and groups, no
    capabilities, no_new_privs."""
    st = status(pid)
    uid, gid = st["Uid"].split()[0], st["Gid"].split()[0]
    groups = ",".join(st["Groups"].split()) or "-"
    enter = ["nsenter", f"--target={pid}", "--mount", "--ipc", "--uts", "--net", "--"]
    become = ["setpriv", f"--reuid={uid}", f"--regid={gid}", f"--groups={groups}"]
    bare = ["--no-new-privs", "--bounding-set=-all", "--inh-caps=-all", "--"]
    return subprocess.run(
        [*enter, *become, *bare, *argv],
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_each_qemu_runs_as_its_own_user_without_privileges(
    pair: tuple[Sandbox, Sandbox],
) -> None:
    pids = [qemu_of(sb.id) for sb in pair]
    uids = []
    for pid in pids:
        st = status(pid)
        ids = {int(x) for x in st["Uid"].split() + st["Gid"].split()}
        assert len(ids) == 1 and ids.pop() > JAIL_BASE, st["Uid"]  # real, effective, saved
        uids.append(int(st["Uid"].split()[0]))
        assert st["Groups"].split() == [str(JAIL_BASE)]  # the image group, nothing else
        assert st["Seccomp"] == "2" and st["NoNewPrivs"] == "1"
        for caps in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
            assert int(st[caps], 16) == 0, (caps, st[caps])
    assert uids[0] != uids[1]  # two jailed VMs never share a uid


def test_a_jail_holds_only_its_own_files(daemon: Daemon, pair: tuple[Sandbox, Sandbox]) -> None:
    a, b = pair
    other = b.snapshot("the-other-ones")
    try:
        kept = daemon.data_dir / "snapshots" / other.id
        assert kept.is_dir() and any(kept.iterdir())  # on the host: its memory and disk
        root = Path(f"/proc/{qemu_of(a.id)}/root")
        data = Path(str(daemon.data_dir).lstrip("/"))
        seen = {p.relative_to(root / data) for p in (root / data).rglob("*")}
        own = Path("vms") / a.id
        assert own / "disk.qcow2" in seen  # control: the walk sees its own overlay
        assert all(p.parts[:2] in (own.parts, ("vms",)) or p.parts[0] == "snapshots" for p in seen)
        assert not any(b.id in str(p) or other.id in str(p) for p in seen)  # nothing of b's
        for secret in ("cella.db", "service.key", "admin.key"):
            assert Path(secret) not in seen
    finally:
        other.delete()
    # the KVM device only for a VM that runs under KVM (and then it is all of /dev/kvm)
    assert (root / "dev" / "kvm").exists() is (a.info.accel == "kvm"), a.info.accel
    assert not (root / "proc" / "1").exists() and not (root / "etc" / "shadow").exists()


def test_a_helper_in_the_jail_reads_nothing_else(
    daemon: Daemon, pair: tuple[Sandbox, Sandbox]
) -> None:
    a, b = pair
    pid = qemu_of(a.id)
    vms = daemon.data_dir / "vms"
    control = in_jail(pid, "head", "-c", "3", str(vms / a.id / "disk.qcow2"))
    assert control.returncode == 0 and control.stdout.startswith("QFI"), control.stderr
    for target in (
        vms / b.id / "disk.qcow2",
        daemon.data_dir / "cella.db",
        daemon.data_dir / "service.key",
        daemon.data_dir / "admin.key",
    ):
        probe = in_jail(pid, "head", "-c", "3", str(target))
        assert probe.returncode != 0 and "No such file" in probe.stderr, (target, probe)
    # the jail's own root and binds cannot be changed, the read-only ones not even by
    # the VM's own uid
    for path in ("/usr/bin/env", str(Paths.default().images)):
        probe = in_jail(pid, "sh", "-c", f"touch {path}/x || touch {path}")
        assert probe.returncode != 0, (path, probe)
    written = vms / a.id / "written-from-the-jail"  # control: its own directory takes a write
    control = in_jail(pid, "sh", "-c", f"echo x > {written}")
    try:
        assert control.returncode == 0 and written.read_text() == "x\n", control.stderr
    finally:
        written.unlink(missing_ok=True)
    assert in_jail(pid, "sh", "-c", "exec 3</dev/urandom").returncode == 0  # control
    probe = in_jail(pid, "sh", "-c", "exec 3</dev/kvm")
    if a.info.accel == "kvm":  # bound for a VM under KVM, and its group may open it
        assert probe.returncode == 0, probe.stderr
    else:
        assert probe.returncode != 0 and "No such file" in probe.stderr
    # the other VM's overlay is closed to this uid even outside the jail's namespaces
    other = vms / b.id / "disk.qcow2"
    assert os.stat(other).st_uid != int(status(pid)["Uid"].split()[0])
    assert os.stat(other).st_mode & 0o077 == 0 and os.stat(other.parent).st_mode & 0o077 == 0


@pytest.mark.parametrize("jailed", [True, False], ids=["jailed", "control"])
async def test_a_jailed_qemu_cannot_spawn_a_process(jailed: bool, tmp_path: Path) -> None:
    """QEMU is asked to start a program (an `exec:` migration, the one way its monitor
    offers): the jailed one cannot; the same VM without jail and seccomp does."""
    paths = Paths(tmp_path, Paths.default().images)
    ids = JailIds(JAIL_BASE, 65_536) if jailed else None
    driver = QemuDriver(paths, jail=ids, seccomp=jailed)
    await driver.prepare()
    async with VMFactory(driver) as boot:
        vm = await boot("default", memory_mib=256)
        assert vm.directory is not None and vm.qmp is not None
        marker = vm.directory / "spawned"
        await vm.pause()
        with contextlib.suppress(Exception):  # refused, or QEMU stopped by its filter
            await vm.qmp.execute("migrate", {"uri": f"exec:touch {marker}"})
        for _ in range(100):
            if marker.exists() or not vm.running:
                break
            await asyncio.sleep(0.1)
        assert marker.exists() is not jailed
