"""Hardening: a root guest trying to get out, hostile file traffic, faults mid-operation,
secrets at rest, and load. Every test names what it tried and what happened."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest

from cella import Client, Sandbox, errors
from cella.runtime.qemu.vm import SOCKET_ROOT, qemu_cmdline
from tests import reach
from tests.daemon import Daemon, DaemonFactory
from tests.netservers import EchoHandler, Servers, free_loopback_block
from tests.vms import qemu_of, qemu_pids

pytestmark = [pytest.mark.vm, pytest.mark.hardening]

SECRET = "hArd3n-SECRET-value-91c2"


@pytest.fixture(scope="module")
def web() -> Iterator[tuple[str, Any]]:
    servers = Servers()
    addr = f"{free_loopback_block()}.1"
    seen = servers.start(EchoHandler, (addr, 80))
    yield addr, seen
    servers.close()


@pytest.fixture(scope="module")
def daemon_settings(web: tuple[str, Any]) -> dict[str, str]:
    return {
        "pool_size": "0",
        "max_upload_mib": "8",
        # the operator's two doors, for the controls: names, and a network tenants may open
        "egress_hosts": json.dumps({"web.test": web[0], "api.test": "127.0.0.1"}),
        "egress_tenant_networks": json.dumps([f"{web[0]}/32"]),
    }


def sh(sb: Sandbox, command: str, timeout: float = 60) -> tuple[int | None, str]:
    r = sb.exec(command, timeout=timeout)
    return r.exit_code, (r.stdout + r.stderr).decode(errors="replace")


def sockets_of(vm_dir: Path) -> Path:
    """Where a VM's sockets live (as `socket_dir` computes it, without creating it)."""
    import hashlib

    return SOCKET_ROOT / hashlib.sha256(str(vm_dir.resolve()).encode()).hexdigest()[:20]


def vms_of(data_dir: Path) -> list[int]:
    return [p for p in qemu_pids() if f"{data_dir}/vms/" in " ".join(qemu_cmdline(p))]


def test_a_root_guest_cannot_reach_out(admin: Client, daemon: Daemon, web: tuple[str, Any]) -> None:
    """Every way out of the guest goes through the egress proxy; with the broadest address
    rules there are, it still refuses the host's loopback (the daemon, a test server, a
    neighbour's service URL) and names no rule allows. The control: a sandbox whose rules
    open exactly those paths through the operator's doors (a name in its host table, an
    address in the network it lets tenants open) gets through with the same probes."""
    api_port = daemon.port
    neighbour = admin.create()
    victim = admin.create(allow=["0.0.0.0/0", "::/0"])
    control = admin.create(allow=reach.control_rules(web[0], api_port))
    try:
        reach.serve_marker(neighbour)
        exposed = neighbour.expose(8000, expires_in_seconds=600)
        # (the victim's probe, the control's probe of the same server)
        doors = reach.doors(web[0], api_port, exposed)
        local: dict[str, reach.Target] = {
            "a port of the egress address nothing serves": ["tcp", reach.EGRESS, api_port],
            "control: the egress address's proxy port": ["tcp", reach.EGRESS, 3128],
            "the agent's serial port, again": ["port"],
        }
        seen_before = len(web[1].requests)
        blocked = reach.probe(victim, {k: v[0] for k, v in doors.items()} | local)
        print(json.dumps(blocked, indent=1))
        for name in doors:  # refused by the proxy itself, not by the server behind it
            assert blocked[name].startswith("denied 403 cella egress"), (name, blocked[name])
        assert len(web[1].requests) == seen_before  # nothing reached the test server
        assert "ConnectionRefused" in blocked["a port of the egress address nothing serves"]
        assert blocked["control: the egress address's proxy port"] == "open"
        serial = blocked["the agent's serial port, again"]
        assert "EBUSY" in serial or "Errno 16" in serial, serial
        opened = reach.probe(control, {k: v[1] for k, v in doors.items()})
        print(json.dumps(opened, indent=1))
        for name in doors:
            assert opened[name].startswith("open 200 "), (name, opened[name])
        assert "neighbour-marker" in opened["the neighbour's server by its service URL"]
        assert len(web[1].requests) == seen_before + 2

        # the guest could see host files only through a device or a share: it has neither
        _, inv = sh(
            victim,
            "cat /sys/bus/virtio/devices/*/device | sort -u | xargs; ls /sys/class/net | xargs; "
            "cut -d' ' -f3 /proc/mounts | sort -u | xargs; tail -n +2 /proc/net/route | wc -l",
        )
        devices, nets, fstypes, routes = inv.splitlines()[:4]
        # block (2), console (3), rng (4); no net (1), 9p (9), vsock (19), virtiofs (26)
        assert devices.split() == ["0x0002", "0x0003", "0x0004"], devices
        assert nets.split() == ["lo"], nets
        assert "proc" in fstypes.split(), fstypes  # control: the mount list was read
        assert not {"9p", "virtiofs", "nfs", "nfs4", "cifs", "fuse"} & set(fstypes.split())
        assert routes.strip() == "0", routes  # no route at all in the main table
        (pid,) = [
            p for p in vms_of(daemon.data_dir) if f"/{victim.id}/" in " ".join(qemu_cmdline(p))
        ]
        argv = " ".join(qemu_cmdline(pid))
        assert "virtio-blk-device" in argv  # control: this is the VM's own command line
        shares = ("-netdev", "-nic", "virtio-net", "-fsdev", "-virtfs", "vhost-user-fs", "vsock")
        assert not [w for w in shares if w in argv], argv
        assert sh(victim, "echo still answering")[1] == "still answering\n"
        assert sh(neighbour, "echo fine")[1] == "fine\n"
    finally:
        for sb in (victim, control, neighbour):
            sb.delete()


def test_secret_bytes_are_nowhere_at_rest(
    admin: Client, daemon: Daemon, web: tuple[str, Any]
) -> None:
    admin.put_secret("hardkey", SECRET, ["web.test"])
    sb = admin.create(allow=["web.test"], secrets={"KEY": "hardkey"})
    try:
        code, out = sh(sb, 'curl -sSf -H "Authorization: Bearer $KEY" http://web.test/use')
        assert code == 0, out
        assert web[1].requests[-1]["headers"]["authorization"] == f"Bearer {SECRET}"  # used
        sb.exec("sync")
        snap = sb.snapshot("after-use")
        flat = daemon.data_dir / "snapshots" / snap.id
        deadline = time.monotonic() + 60  # its RAM layer is flattened in the background
        while (flat / "ram.layer").exists() or not (flat / "ram").exists():
            assert time.monotonic() < deadline, sorted(p.name for p in flat.iterdir())
            time.sleep(0.1)
        needle = SECRET.encode()
        searched = []
        for path in [
            *sorted((daemon.data_dir / "snapshots" / snap.id).iterdir()),
            *sorted((daemon.data_dir / "vms" / sb.id).glob("*.qcow2")),
            daemon.data_dir / "daemon.log",
            daemon.data_dir / "egress" / "proxy.log",
        ]:
            if path.is_file():
                searched.append(path.name)
                with path.open("rb") as f:
                    while chunk := f.read(8 << 20):
                        assert needle not in chunk, f"{SECRET} found in {path}"
        assert {"ram", "state", "disk.qcow2", "daemon.log", "proxy.log"} <= set(searched)
        events = json.dumps([e.model_dump(mode="json") for e in admin.events(sb.id)])
        assert SECRET not in events
    finally:
        sb.delete()
        admin.get_snapshot(snap.id).delete()


def _tar(members: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def _file(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def _link(name: str, target: str) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type = tarfile.SYMTYPE
    info.linkname = target
    return info, None


def _special(name: str, kind: bytes, target: str = "") -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = target
    info.devmajor, info.devminor = 1, 3  # for a device node: what /dev/null is
    return info, None


# a tar of the guest's own, first in PATH: `tar -c -C /workspace/NAME .` (what the agent runs
# for a download) hands out /crafted/NAME.tar instead
TAR_SHIM = """#!/bin/sh
if [ "$1" = "-c" ]; then exec cat "/crafted/$(basename "$3").tar"; fi
exec /usr/bin/tar "$@"
"""


def test_a_guest_crafted_archive_lands_nothing_outside(
    admin: Client, daemon: Daemon, tmp_path: Path
) -> None:
    """The guest decides what a download holds. `cella sandbox cp` out of it: `..`, an
    absolute path, a symlink then a write through it, a hard link to a host file and a
    device node land nothing outside the destination; the control is a plain archive,
    handed out the same way, that is copied."""
    victim = tmp_path / "victim.txt"
    victim.write_text("host file\n")
    outside = tmp_path / "outside"
    outside.mkdir()
    crafted = {
        "plain": _tar([_file("fine.txt", b"ok")]),
        "dotdot": _tar([_file("../../escaped-dotdot", b"x")]),
        "absolute": _tar([_file(f"{outside}/escaped-absolute", b"x")]),
        "symlink": _tar([_link("out", str(outside)), _file("out/escaped-through-link", b"x")]),
        "hardlink": _tar([_special("hl", tarfile.LNKTYPE, str(victim))]),
        "device": _tar([_special("null0", tarfile.CHRTYPE)]),
    }
    with admin.create() as sb:
        assert sh(sb, "mkdir -p /crafted")[0] == 0
        for name, archive in crafted.items():
            sb.files.write(f"/crafted/{name}.tar", archive)
        sb.files.write("/usr/local/bin/tar", TAR_SHIM)
        code, out = sh(
            sb,
            "chmod 755 /usr/local/bin/tar && mkdir -p /workspace/" + " /workspace/".join(crafted),
        )
        assert code == 0, out

        def cp_out(name: str) -> subprocess.CompletedProcess[str]:
            dest = tmp_path / "dest" / name
            return subprocess.run(
                [sys.executable, "-m", "cella.cli", "sandbox", "cp", f"{sb.id}:/workspace/{name}",
                 str(dest)],
                env=daemon.env(None), capture_output=True, text=True, timeout=120,
            )  # fmt: skip

        plain = cp_out("plain")  # control: the shim's archive is what cp receives
        assert plain.returncode == 0, plain.stderr
        assert (tmp_path / "dest" / "plain" / "fine.txt").read_text() == "ok"
        results = {name: cp_out(name) for name in crafted if name != "plain"}
        print({n: (r.returncode, r.stderr.strip()[-200:]) for n, r in results.items()})
        for name in ("dotdot", "symlink", "hardlink", "device"):
            assert results[name].returncode != 0, (name, results[name].stdout)
        # nothing outside: not next to the destination, not in the linked directory, the
        # host file untouched and not linked into the copy
        assert not (tmp_path / "escaped-dotdot").exists()
        assert not (tmp_path / "dest" / "escaped-dotdot").exists()
        assert sorted(p.name for p in outside.iterdir()) == []
        assert victim.read_text() == "host file\n" and victim.stat().st_nlink == 1
        assert not any(p.is_char_device() for p in (tmp_path / "dest").rglob("*"))
        # an absolute member is taken as relative: inside the destination, or refused
        absolute = results["absolute"]
        inside = tmp_path / "dest" / "absolute" / str(outside).lstrip("/") / "escaped-absolute"
        assert absolute.returncode != 0 or inside.exists(), absolute.stderr


def test_hostile_archives_and_uploads(admin: Client, daemon: Daemon, tmp_path: Path) -> None:
    with admin.create() as sb:
        attempts = {
            "climb out with ../": _tar([_file("../../escaped-dotdot", b"x")]),
            "absolute member": _tar([_file("/escaped-absolute", b"x")]),
            "write through a symlink out": _tar(
                [_link("out", "/etc"), _file("out/escaped-through-link", b"x")]
            ),
            "symlink then ../ through it": _tar(
                [_link("up", ".."), _file("up/up/escaped-up", b"x")]
            ),
        }
        outcomes = {}
        for name, archive in attempts.items():
            try:
                sb.files.upload_archive("/workspace/t", archive)
                outcomes[name] = "accepted"
            except errors.CellaError as exc:
                outcomes[name] = f"refused: {exc.code}"
        print(json.dumps(outcomes, indent=1))
        # GNU tar in the guest refuses `..` members and writes through links it made; it
        # strips a leading / (that member lands inside the target)
        assert outcomes == {
            "climb out with ../": "refused: invalid_argument",
            "absolute member": "accepted",
            "write through a symlink out": "refused: invalid_argument",
            "symlink then ../ through it": "refused: invalid_argument",
        }, outcomes
        code, found = sh(
            sb,
            "ls -d /escaped-dotdot /escaped-absolute /etc/escaped-through-link /escaped-up "
            "/workspace/escaped-dotdot /workspace/escaped-up 2>&1",
        )
        assert code != 0 and found.count("No such file or directory") == 6, found
        _, inside = sh(sb, "cd /workspace/t && find . -type f | sort")
        assert inside.split() == ["./escaped-absolute"], inside  # the one accepted, inside
        # control: a plain archive is unpacked where asked
        sb.files.upload_archive("/workspace/t", _tar([_file("plain.txt", b"plain")]))
        assert sb.files.read_text("/workspace/t/plain.txt") == "plain"

        # a guest can put anything in an archive it hands out: the CLI's extraction
        # (tarfile, filter="data") refuses links that leave the destination
        code, out = sh(
            sb,
            "mkdir -p /workspace/abs /workspace/rel /workspace/good && "
            "ln -s /etc /workspace/abs/evil && ln -s ../../../../tmp /workspace/rel/up && "
            "echo ok > /workspace/good/fine && ln -s fine /workspace/good/inside",
        )
        assert code == 0, out

        def cp_out(src: str, dest: Path) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [sys.executable, "-m", "cella.cli", "sandbox", "cp", f"{sb.id}:{src}", str(dest)],
                env=daemon.env(None), capture_output=True, text=True, timeout=120,
            )  # fmt: skip

        good = cp_out("/workspace/good", tmp_path / "good")  # control: cp copies a tree,
        assert good.returncode == 0, good.stderr  # links that stay inside included
        assert (tmp_path / "good" / "fine").read_text() == "ok\n"
        assert (tmp_path / "good" / "inside").is_symlink()
        assert (tmp_path / "good" / "inside").read_text() == "ok\n"
        for src, name, why in (
            ("/workspace/abs", "evil", "absolute path"),
            ("/workspace/rel", "up", "outside the destination"),
        ):
            # control: the archive the CLI receives really holds the hostile link
            with tarfile.open(fileobj=io.BytesIO(sb.files.download_archive(src))) as tar:
                assert [m.linkname for m in tar.getmembers() if m.issym()]
            dest = tmp_path / name
            copied = cp_out(src, dest)
            assert copied.returncode != 0 and why in copied.stderr, (
                copied.returncode, copied.stderr[-800:])  # fmt: skip
            assert not (dest / name).is_symlink() and not (dest / name).exists()

        # uploads: over the limit (declared or streamed without a length), odd paths
        def endless() -> Iterator[bytes]:
            for _ in range(12):
                yield b"x" * (1 << 20)

        with pytest.raises(errors.PayloadTooLarge):
            sb.files.write("/workspace/huge", endless())
        with pytest.raises(errors.PayloadTooLarge):
            sb.files.write("/workspace/huge", b"x" * (9 << 20))
        assert not sb.files.exists("/workspace/huge")  # nothing half-written
        for bad in ("/tmp/a\x00b", "relative/path", ""):
            with pytest.raises(errors.InvalidArgument):
                sb.files.write(bad, b"x")
        raw = httpx2.put(
            f"{daemon.url}/v1/sandboxes/{sb.id}/files/content?path=/tmp/%ff%fe",
            headers={"Authorization": f"Bearer {daemon.admin_key}"},
            content=b"odd",
        )
        assert raw.status_code < 500
        odd = "/tmp/ünïcödé 😀 $(reboot).txt"
        sb.files.write(odd, "still fine")
        assert sb.files.read_text(odd) == "still fine"
        assert sh(sb, "echo alive")[1] == "alive\n"


def test_faults_end_in_clear_states_without_leaks(admin: Client, daemon: Daemon) -> None:
    # QEMU killed -9 during an exec: the exec fails at once, the sandbox is stopped with the
    # reason, and its disk (files written before) comes back on resume
    sb = admin.create()
    sb.files.write("/workspace/kept.txt", "before the crash")
    sb.exec("sync")
    result: dict[str, Any] = {}

    def long_exec() -> None:
        try:
            result["exec"] = sb.exec("sleep 60", timeout=120)
        except errors.CellaError as exc:
            result["error"] = exc

    t = threading.Thread(target=long_exec)
    t.start()
    deadline = time.monotonic() + 60
    while sb.exec(["pgrep", "-fx", "sleep 60"]).exit_code != 0:  # in flight: seen running
        assert t.is_alive() and time.monotonic() < deadline, result
        time.sleep(0.05)
    (pid,) = [p for p in vms_of(daemon.data_dir) if f"/{sb.id}/" in " ".join(qemu_cmdline(p))]
    started = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    t.join(60)
    assert not t.is_alive() and time.monotonic() - started < 30
    assert isinstance(result.get("error"), errors.SandboxCrashed), result
    crashed = admin.get(sb.id)
    assert crashed.state == "stopped" and "unexpectedly" in str(crashed.info.error)
    assert "crashed" in [e.type for e in admin.events(sb.id)]
    assert not sockets_of(daemon.data_dir / "vms" / sb.id).exists()  # QMP/agent sockets gone
    crashed.resume()
    assert crashed.files.read_text("/workspace/kept.txt") == "before the crash"
    crashed.delete()
    assert not sockets_of(daemon.data_dir / "vms" / sb.id).exists()
    assert not (daemon.data_dir / "vms" / sb.id).exists()
    assert vms_of(daemon.data_dir) == []
    assert not any(sb.id in " ".join(qemu_cmdline(p)) for p in qemu_pids())


def _qemus_with(fragment: str) -> list[int]:
    return [p for p in qemu_pids() if fragment in " ".join(qemu_cmdline(p))]


def _kill_daemon_when(
    hard: Daemon,
    action: Any,
    under_way: Any,
    while_down: Any = None,
    freeze: Any = None,
    timeout: float = 120,
) -> None:
    """Starts `action`, waits until `under_way()` shows the operation in progress and kills
    the daemon -9 in that state, then starts it again (`while_down()` runs in between). The
    daemon and `freeze()` (more processes of the operation) are stopped before `under_way()`
    is asked again, so the kill lands while the operation is in progress, not just after it.
    The action must not have completed."""
    assert hard.proc is not None
    daemon = hard.proc.pid
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = action()
        except BaseException as exc:  # the daemon dies under it: that is the point
            outcome["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    deadline = time.monotonic() + timeout
    while True:
        if under_way():
            frozen = [daemon, *(freeze() if freeze else [])]
            for pid in frozen:
                os.kill(pid, signal.SIGSTOP)
            if under_way():
                break
            for pid in frozen:
                os.kill(pid, signal.SIGCONT)
        assert t.is_alive(), f"it finished before it was seen under way: {outcome}"
        assert time.monotonic() < deadline, "the operation was never seen under way"
        time.sleep(0.005)
    hard.kill9()  # SIGKILL ends a stopped process too (and the QEMUs that die with it)
    t.join(30)
    try:
        if while_down is not None:
            while_down()
    finally:
        hard.start()
    assert not t.is_alive() and "result" not in outcome, outcome


def reads_memory_of(reader: int, pid: int) -> bool:
    """`reader` holds `/proc/PID/mem` open: it is copying that process's memory (the daemon
    opens it only to read a RAM layer out of a paused VM)."""
    mem = f"/proc/{pid}/mem"
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{reader}/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{reader}/fd/{fd}") == mem:
                    return True
    return False


def qmp_status(vm_dir: Path) -> str:
    """The run state QEMU itself reports for a VM (asked on its QMP socket, which takes a
    new client once the daemon's connection is gone)."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(str(sockets_of(vm_dir) / "qmp"))
        stream = s.makefile("rwb")
        stream.readline()  # the greeting
        for command in ("qmp_capabilities", "query-status"):
            stream.write(json.dumps({"execute": command}).encode() + b"\n")
            stream.flush()
            while "return" not in (reply := json.loads(stream.readline())):
                assert "error" not in reply, reply  # events come in between
        status: str = reply["return"]["status"]
        return status


def _allocated(path: Path) -> int:
    try:
        return path.stat().st_blocks * 512
    except FileNotFoundError:
        return 0


def test_daemon_killed_during_snapshot_and_fork(daemon: Daemon, tmp_path: Path) -> None:
    dirt = 200 << 20
    with daemon.client() as c:
        parent = c.create()
        parent.files.write("/workspace/state.txt", "parent data")
        # 200 MiB written since its restore: its snapshot's RAM layer takes a while to read
        parent.exec(f"head -c {dirt} /dev/urandom > /dev/shm/dirt", timeout=300)
        parent.exec("nohup sleep 1000 >/dev/null 2>&1 &")
        parent_id = parent.id
    parent_dir = daemon.data_dir / "vms" / parent_id
    snapshots = daemon.data_dir / "snapshots"
    scratch = f"{snapshots}/."

    def recovered(name: str) -> None:
        """The interrupted snapshot failed; the parent, left paused, was adopted and runs
        on (not rebooted); nothing of the snapshot is left."""
        with daemon.client() as c:
            snaps = [s for s in c.snapshots() if s.info.name == name]
            assert [(s.info.state, s.info.error) for s in snaps] == [("error", "daemon restarted")]
            again = c.get(parent_id)
            assert again.state == "running"  # adopted (migration cancelled, vCPUs resumed)
            assert "adopted" in [e.type for e in again.events()]
            assert again.exec(["pgrep", "-x", "sleep"]).exit_code == 0  # not rebooted
            assert again.files.read_text("/workspace/state.txt") == "parent data"
        assert not list(snapshots.glob(".*"))  # no scratch left
        assert not _qemus_with(scratch)  # no helper QEMU left

    def left_paused() -> None:  # the kill landed inside the snapshot's pause
        assert qmp_status(parent_dir) == "paused"

    # killed while the daemon reads the RAM layer out of the paused VM (a restored VM's
    # snapshot: the pages it wrote, read through /proc/PID/mem, no helper)
    parent_qemu = qemu_of(parent_id)
    daemon_pid = daemon.proc.pid if daemon.proc else 0
    with daemon.client() as c:
        _kill_daemon_when(
            daemon,
            lambda: c.get(parent_id).snapshot("interrupted"),
            lambda: reads_memory_of(daemon_pid, parent_qemu),
            left_paused,
        )
    recovered("interrupted")

    # killed while a booted VM's RAM goes to the snapshot's helper QEMU: the helper is
    # stopped with part of it received (the migration runs between the two QEMUs, so the
    # helper is frozen too, and dies with the daemon)
    with daemon.client() as c:
        c.get(parent_id).stop()
        booted = c.get(parent_id).resume()
        booted.exec(f"head -c {dirt} /dev/urandom > /dev/shm/dirt", timeout=300)
        booted.exec("nohup sleep 1000 >/dev/null 2>&1 &")
    received: list[int] = []

    def helper_receiving() -> bool:  # more than the helper writes itself (kernel, initrd)
        received[:] = [_allocated(r) for r in snapshots.glob(".snap-*/ram")]
        return bool(_qemus_with(scratch)) and any(n > dirt // 4 for n in received)

    def mid_copy() -> None:
        print(f"the helper had {received[0] >> 20} MiB of the RAM when the daemon was killed")
        assert len(received) == 1 and received[0] < dirt, received  # part of it, not all
        left_paused()

    with daemon.client() as c:
        _kill_daemon_when(
            daemon,
            lambda: c.get(parent_id).snapshot("interrupted-booted"),
            helper_receiving,
            mid_copy,
            freeze=lambda: _qemus_with(scratch),
        )
    recovered("interrupted-booted")

    with daemon.client() as c:
        snap_id = c.get(parent_id).snapshot("for-fork").id
    branch_ram = f"{daemon.data_dir}/snapshots/{snap_id}/ram"
    # killed while forks are being restored
    with daemon.client() as c:
        _kill_daemon_when(
            daemon, lambda: c.get_snapshot(snap_id).fork(3), lambda: bool(_qemus_with(branch_ram))
        )
    with daemon.client() as c:
        rows = [s for s in c.list() if s.info.snapshot_id == snap_id]
        assert rows and all(s.state in ("running", "error") for s in rows), rows
        interrupted = [s for s in rows if s.state == "error"]
        assert interrupted, rows  # the kill landed while a branch was being restored
        for s in interrupted:
            assert "interrupted while being created" in str(s.info.error)
            assert not (daemon.data_dir / "vms" / s.id).exists()
        for s in rows:
            if s.state == "running":
                assert s.files.read_text("/workspace/state.txt") == "parent data"
            s.delete()
        assert c.get(parent_id).files.read_text("/workspace/state.txt") == "parent data"
        fresh = c.get_snapshot(snap_id).fork(1)[0]  # the snapshot itself is intact
        assert fresh.files.read_text("/workspace/state.txt") == "parent data"
        fresh.delete()
        c.get(parent_id).delete()
        c.get_snapshot(snap_id).delete()
        live = {s.id for s in c.list() if s.state != "error"}
    # nothing leaked: no QEMU, overlay or socket directory of a sandbox that is gone
    on_disk = {p.name for p in (daemon.data_dir / "vms").iterdir()}
    assert on_disk <= live, on_disk - live
    assert len(vms_of(daemon.data_dir)) == len(live), (vms_of(daemon.data_dir), live)
    assert not _qemus_with(scratch)


@pytest.mark.slow
def test_load_50_creates_and_500_execs_without_errors_or_leaks(daemon: Daemon) -> None:
    import asyncio

    from bench.load import leaks, run_load

    result = asyncio.run(run_load(daemon.url, daemon.admin_key, 50, 500))
    assert result["errors"] == []
    assert result["created"] == 50 and len(result["exec_times"]) == 500
    deadline = time.monotonic() + 20
    while leaks(daemon.data_dir) != {"qemu": 0, "vm_dirs": 0} and time.monotonic() < deadline:
        time.sleep(0.5)
    assert leaks(daemon.data_dir) == {"qemu": 0, "vm_dirs": 0}


@pytest.fixture()
def small_data_dir(tmp_path: Path) -> Iterator[Path]:
    """A 400 MiB file system for a daemon's data directory, to fill up on purpose."""
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400m", "tmpfs", str(mount)], check=True)
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_data_directory_filling_up_during_a_snapshot(
    small_data_dir: Path, daemon_factory: DaemonFactory
) -> None:
    d = daemon_factory(data_dir=small_data_dir / "data", pool_size="0")
    with d.client() as c:
        sb = c.create(memory_mib=256)
        sb.files.write("/workspace/keep.txt", "precious")
        snapshots = d.data_dir / "snapshots"
        filler = small_data_dir / "filler"
        filled = threading.Event()

        def fill_when_the_snapshot_starts() -> None:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                if snapshots.exists() and any(snapshots.glob(".snap-*")):
                    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
                    for size in (4 << 20, 4096):  # every last block
                        with contextlib.suppress(OSError):
                            while os.write(fd, b"\1" * size):
                                pass
                    os.close(fd)
                    filled.set()
                    return
                time.sleep(0.002)

        filler_thread = threading.Thread(target=fill_when_the_snapshot_starts)
        filler_thread.start()
        with pytest.raises(errors.NoSpace) as refused:
            sb.snapshot("into a full disk")
        filler_thread.join()
        assert filled.is_set()
        print("snapshot refused:", refused.value)
        failed = [s for s in c.snapshots() if s.info.name == "into a full disk"]
        assert [s.info.state for s in failed] == ["error"]
        assert not list(snapshots.glob(".*"))  # its scratch files are gone
        assert sb.refresh().state == "running"
        assert sb.files.read_text("/workspace/keep.txt") == "precious"
        # with the disk still full, a new snapshot is refused before anything is written
        with pytest.raises(errors.NoSpace, match="MiB free"):
            sb.snapshot("still full")
        filler.unlink()
        assert sb.snapshot("with room").info.state == "ready"
        sb.delete()
