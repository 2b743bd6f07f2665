"""Hardening: a root guest trying to get out, hostile file traffic, faults mid-operation,
secrets at rest, and load. Every test names what it tried and what happened."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
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
from tests.conftest import qemu_pids
from tests.daemon import Daemon, kill_vms_of, running_daemon
from tests.netservers import EchoHandler, Servers, free_loopback_block

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
def hard(tmp_path_factory: pytest.TempPathFactory, web: tuple[str, Any]) -> Iterator[Daemon]:
    with running_daemon(
        tmp_path_factory.mktemp("hard"),
        pool_size="0",
        max_upload_mib="8",
        egress_hosts=json.dumps({"web.test": web[0]}),
    ) as d:
        yield d


@pytest.fixture(scope="module")
def client(hard: Daemon) -> Iterator[Client]:
    with Client(hard.url, hard.admin_key) as c:
        yield c


def sh(sb: Sandbox, command: str, timeout: float = 60) -> tuple[int | None, str]:
    r = sb.exec(command, timeout=timeout)
    return r.exit_code, (r.stdout + r.stderr).decode(errors="replace")


def sockets_of(vm_dir: Path) -> Path:
    """Where a VM's sockets live (as `socket_dir` computes it, without creating it)."""
    import hashlib

    return SOCKET_ROOT / hashlib.sha256(str(vm_dir.resolve()).encode()).hexdigest()[:20]


def vms_of(data_dir: Path) -> list[int]:
    return [p for p in qemu_pids() if f"{data_dir}/vms/" in " ".join(qemu_cmdline(p))]


ESCAPE = r"""
import errno, glob, json, os, socket, sys
targets = json.loads(sys.argv[1])
out = {}
def attempt(name, fn):
    try:
        result = fn()
        out[name] = f"REACHED {result!r}"
    except Exception as e:
        out[name] = f"blocked {type(e).__name__}: {e}"
def tcp(host, port):
    s = socket.create_connection((host, port), timeout=3)
    s.sendall(b"GET / HTTP/1.0\r\n\r\n")
    data = s.recv(200)
    s.close()
    if b" 403 " in data.split(b"\r\n")[0] or not data:
        raise PermissionError(f"proxy said {data[:60]!r}")
    return data[:60]
def unix(path):
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    return "connected"
def read(path):
    with open(path, "rb") as f:
        return f.read(100)
def port():
    ports = glob.glob("/dev/vport*") + glob.glob("/dev/virtio-ports/*")
    if not ports:
        raise FileNotFoundError("no virtio ports visible")
    for p in ports:
        fd = os.open(p, os.O_RDWR)  # the agent holds it: a second opener gets EBUSY
        os.write(fd, b"\xff" * 64)
        return f"opened {p}"
def proxied(url):
    s = socket.create_connection(("10.0.2.100", 3128), timeout=5)
    s.sendall(f"GET {url} HTTP/1.0\r\n\r\n".encode())
    data = s.recv(200)
    s.close()
    if b" 403 " in data.split(b"\r\n")[0]:
        raise PermissionError(data.split(b"\r\n")[0].decode())
    return data[:60]
def icmp(host):
    s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
    s.settimeout(2)
    s.sendto(b"\x08\x00\xf7\xff\x00\x00\x00\x00", (host, 0))
    return s.recv(100)[:20]
for name, (kind, *args) in targets.items():
    attempt(name, lambda: {"tcp": tcp, "unix": unix, "read": read, "port": port,
                           "proxy": proxied, "icmp": icmp}[kind](*args))
print(json.dumps(out))
"""


def test_a_root_guest_cannot_reach_out(client: Client, hard: Daemon, tmp_path: Path) -> None:
    marker = hard.data_dir / "host-only-marker.txt"
    marker.write_text("host secret file\n")
    api_port = int(hard.url.rsplit(":", 1)[1])
    neighbour = client.create()
    victim = client.create()
    try:
        sockets = [str(p) for p in Path("/run/cella").rglob("*") if p.is_socket()][:4]
        assert sockets  # the host has QMP and agent sockets: the guest must not reach them
        targets: dict[str, list[object]] = {
            "daemon API at the gateway": ["tcp", "10.0.2.2", api_port],
            "daemon API through the proxy": ["proxy", f"http://127.0.0.1:{api_port}/v1/health"],
            "host loopback through the proxy": ["proxy", "http://localhost:22/"],
            "metadata address": ["tcp", "169.254.169.254", 80],
            "metadata through the proxy": ["proxy", "http://169.254.169.254/latest/"],
            "neighbour sandbox's address": ["tcp", "10.0.2.15", 8000],
            "ping the gateway": ["icmp", "10.0.2.2"],
            "ping a public address": ["icmp", "192.0.2.1"],
            "the agent's serial port, again": ["port"],
            "host file in the data directory": ["read", str(marker)],
            "a host-only path, read in the guest": ["read", "/etc/cella-host-marker"],
            **{f"host socket {s}": ["unix", s] for s in sockets},
        }
        victim.files.write("/tmp/escape.py", ESCAPE)
        r = victim.exec(
            ["python3", "/tmp/escape.py", json.dumps(targets)],
            env={"no_proxy": ""},
            timeout=120,
        )
        assert r.exit_code == 0, r.stderr
        outcome = json.loads(r.stdout)
        print(json.dumps(outcome, indent=1))  # each attempt and what happened
        assert set(outcome) == set(targets)
        reached = {k: v for k, v in outcome.items() if not v.startswith("blocked")}
        assert not reached, reached  # the VM has no NIC: nothing answers, not even a gateway
        assert outcome["ping a public address"].startswith("blocked")
        assert "EBUSY" in outcome["the agent's serial port, again"] or "Errno 16" in str(
            outcome["the agent's serial port, again"]
        )
        assert sh(victim, "echo still answering")[1] == "still answering\n"
        assert sh(neighbour, "echo fine")[1] == "fine\n"
    finally:
        victim.delete()
        neighbour.delete()


def test_secret_bytes_are_nowhere_at_rest(
    client: Client, hard: Daemon, web: tuple[str, Any]
) -> None:
    client.put_secret("hardkey", SECRET, ["web.test"])
    sb = client.create(allow=["web.test"], secrets={"KEY": "hardkey"})
    try:
        code, out = sh(sb, 'curl -sSf -H "Authorization: Bearer $KEY" http://web.test/use')
        assert code == 0, out
        assert web[1].requests[-1]["headers"]["authorization"] == f"Bearer {SECRET}"  # used
        sb.exec("sync")
        snap = sb.snapshot("after-use")
        needle = SECRET.encode()
        searched = []
        for path in [
            *sorted((hard.data_dir / "snapshots" / snap.id).iterdir()),
            *sorted((hard.data_dir / "vms" / sb.id).glob("*.qcow2")),
            hard.data_dir / "daemon.log",
            hard.data_dir / "egress" / "proxy.log",
        ]:
            if path.is_file():
                searched.append(path.name)
                with path.open("rb") as f:
                    while chunk := f.read(8 << 20):
                        assert needle not in chunk, f"{SECRET} found in {path}"
        assert {"ram", "state", "disk.qcow2", "daemon.log", "proxy.log"} <= set(searched)
        events = json.dumps([e.model_dump(mode="json") for e in client.events(sb.id)])
        assert SECRET not in events
    finally:
        sb.delete()
        client.get_snapshot(snap.id).delete()


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


def test_hostile_archives_and_uploads(client: Client, hard: Daemon, tmp_path: Path) -> None:
    with client.create() as sb:
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
        _, found = sh(
            sb,
            "ls /escaped-dotdot /escaped-absolute /etc/escaped-through-link /escaped-up "
            "/workspace/escaped-dotdot /workspace/escaped-up 2>&1; true",
        )
        assert "escaped" not in found.replace("No such file", "").split("ls:")[0]
        assert found.count("No such file or directory") == 6, found
        # whatever was accepted landed inside the target
        _, inside = sh(sb, "cd /workspace/t && find . -type f | sort")
        assert all(line.startswith("./") for line in inside.split())

        # a guest can put anything in an archive it hands out: the CLI's extraction refuses
        # links that leave the destination
        sh(
            sb,
            "mkdir -p /workspace/out && ln -sf /etc /workspace/out/evil && "
            "ln -sf ../../../../tmp /workspace/out/up && echo ok > /workspace/out/fine",
        )
        dest = tmp_path / "copy"
        copied = subprocess.run(
            [sys.executable, "-m", "cella.cli", "sandbox", "cp", f"{sb.id}:/workspace/out",
             str(dest)],
            env=hard.env(None), capture_output=True, text=True,
        )  # fmt: skip
        for name in ("evil", "up"):
            link = dest / name
            assert not (link.is_symlink() and not str(os.readlink(link)).startswith(str(dest)))
        assert copied.returncode != 0 or (dest / "fine").read_text() == "ok\n"

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
            f"{hard.url}/v1/sandboxes/{sb.id}/files/content?path=/tmp/%ff%fe",
            headers={"Authorization": f"Bearer {hard.admin_key}"},
            content=b"odd",
        )
        assert raw.status_code < 500
        odd = "/tmp/ünïcödé 😀 $(reboot).txt"
        sb.files.write(odd, "still fine")
        assert sb.files.read_text(odd) == "still fine"
        assert sh(sb, "echo alive")[1] == "alive\n"


def test_faults_end_in_clear_states_without_leaks(client: Client, hard: Daemon) -> None:
    # QEMU killed -9 during an exec: the exec fails at once, the sandbox is stopped with the
    # reason, and its disk (files written before) comes back on resume
    sb = client.create()
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
    time.sleep(1.0)
    (pid,) = [p for p in vms_of(hard.data_dir) if f"/{sb.id}/" in " ".join(qemu_cmdline(p))]
    started = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    t.join(60)
    assert not t.is_alive() and time.monotonic() - started < 30
    assert isinstance(result.get("error"), errors.CellaError), result
    crashed = client.get(sb.id)
    assert crashed.state == "stopped" and "unexpectedly" in str(crashed.info.error)
    assert "crashed" in [e.type for e in client.events(sb.id)]
    assert not sockets_of(hard.data_dir / "vms" / sb.id).exists()  # QMP/agent sockets gone
    crashed.resume()
    assert crashed.files.read_text("/workspace/kept.txt") == "before the crash"
    crashed.delete()
    assert not sockets_of(hard.data_dir / "vms" / sb.id).exists()
    assert not (hard.data_dir / "vms" / sb.id).exists()
    assert vms_of(hard.data_dir) == []
    assert not any(sb.id in " ".join(qemu_cmdline(p)) for p in qemu_pids())


def _kill_daemon_during(hard: Daemon, action: Any, delay: float) -> None:
    """Starts `action` against the daemon and kills the daemon -9 while it runs."""
    t = threading.Thread(target=lambda: _swallow(action), daemon=True)
    t.start()
    time.sleep(delay)
    hard.kill9()
    t.join(30)
    hard.start()


def _swallow(action: Any) -> None:
    with contextlib.suppress(Exception):  # the daemon dies under it: that is the point
        action()


def test_daemon_killed_during_snapshot_and_fork(hard: Daemon, tmp_path: Path) -> None:
    with Client(hard.url, hard.admin_key) as c:
        parent = c.create()
        parent.files.write("/workspace/state.txt", "parent data")
        parent_id = parent.id
    # killed while the snapshot's RAM is being copied
    with Client(hard.url, hard.admin_key) as c:
        _kill_daemon_during(hard, lambda: c.get(parent_id).snapshot("interrupted"), 0.4)
    with Client(hard.url, hard.admin_key) as c:
        snaps = [s for s in c.snapshots() if s.info.name == "interrupted"]
        assert all(s.info.state in ("error", "ready") for s in snaps), snaps
        again = c.get(parent_id)
        if again.state != "running":
            again.resume()
        assert again.files.read_text("/workspace/state.txt") == "parent data"
        assert not list((hard.data_dir / "snapshots").glob(".*"))  # no scratch left
        snap = again.snapshot("for-fork")
        snap_id = snap.id
    # killed while forks are being restored
    with Client(hard.url, hard.admin_key) as c:
        _kill_daemon_during(hard, lambda: c.get_snapshot(snap_id).fork(3), 0.3)
    with Client(hard.url, hard.admin_key) as c:
        rows = [s for s in c.list() if s.info.snapshot_id == snap_id]
        assert all(s.state in ("running", "stopped", "error") for s in rows), rows
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
        live = {s.id for s in c.list()}
    # nothing leaked: no QEMU, overlay or socket directory of a sandbox that is gone
    on_disk = {p.name for p in (hard.data_dir / "vms").iterdir()}
    assert on_disk <= live, on_disk - live
    owners = {p for p in vms_of(hard.data_dir)}
    assert len(owners) == len(live), (owners, live)


def test_load_50_creates_and_500_execs_without_errors_or_leaks(hard: Daemon) -> None:
    import asyncio

    from bench.load import leaks, run_load

    result = asyncio.run(run_load(hard.url, hard.admin_key, 50, 500))
    assert result["errors"] == []
    assert result["created"] == 50 and len(result["exec_times"]) == 500
    deadline = time.monotonic() + 20
    while leaks(hard.data_dir) != {"qemu": 0, "vm_dirs": 0} and time.monotonic() < deadline:
        time.sleep(0.5)
    assert leaks(hard.data_dir) == {"qemu": 0, "vm_dirs": 0}


@pytest.fixture()
def small_data_dir(tmp_path: Path) -> Iterator[Path]:
    """A 400 MiB file system for a daemon's data directory, to fill up on purpose."""
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400m", "tmpfs", str(mount)], check=True)
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_data_directory_filling_up_during_a_snapshot(small_data_dir: Path) -> None:
    d = Daemon(small_data_dir / "data", pool_size="0").start()
    try:
        with Client(d.url, d.admin_key) as c:
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
    finally:
        d.stop()
        kill_vms_of(d.data_dir)
