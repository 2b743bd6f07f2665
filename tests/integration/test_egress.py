"""Egress control end to end: real microVMs, the real daemon and proxy, real servers on
loopback addresses (HTTP, HTTPS with a test CA, git smart HTTP)."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from cella import Client, Sandbox
from tests import reach
from tests.daemon import Daemon
from tests.netservers import EchoHandler, GitHandler, Recorder, Servers, TestCA, free_loopback_block

pytestmark = pytest.mark.vm

SECRET = "s3cr3t-VALUE-8c1f0e"
GIT_TOKEN = "ghtok-REAL-5b7d2a"
GUEST_TEST_CA = "/tmp/test-ca.pem"


@dataclass
class Net:
    web: str
    other: str
    git: str
    ca: TestCA
    web_seen: Recorder
    other_seen: Recorder
    git_seen: Recorder
    git_root: Path


@pytest.fixture(scope="module")
def net(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Net]:
    base = tmp_path_factory.mktemp("net")
    prefix = free_loopback_block()
    web, other, git = f"{prefix}.1", f"{prefix}.2", f"{prefix}.3"
    ca = TestCA(base / "ca", ["web.test", "other.test", "git.test"])
    servers = Servers()
    web_seen = servers.start(EchoHandler, (web, 80))
    servers.start(EchoHandler, (web, 443), ca.server_context(), recorder=web_seen)
    other_seen = servers.start(EchoHandler, (other, 80))
    servers.start(EchoHandler, (other, 443), ca.server_context(), recorder=other_seen)
    git_root = base / "git"
    _make_repo(git_root)
    git_seen = servers.start(
        GitHandler, (git, 443), ca.server_context(), root=git_root, token=GIT_TOKEN
    )
    yield Net(web, other, git, ca, web_seen, other_seen, git_seen, git_root)
    servers.close()


def _make_repo(root: Path) -> None:
    root.mkdir()
    work = root / "seed"
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "HOME": str(root)}
    env |= {"GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    run = lambda *a, cwd=root: subprocess.run(a, cwd=cwd, env=env, check=True, capture_output=True)  # noqa: E731
    run("git", "init", "-q", "--bare", "-b", "main", "repo.git")
    run("git", "init", "-q", "-b", "main", "seed")
    (work / "README").write_text("seeded\n")
    run("git", "add", "README", cwd=work)
    run("git", "commit", "-q", "-m", "seed", cwd=work)
    run("git", "push", "-q", str(root / "repo.git"), "main", cwd=work)


@pytest.fixture(scope="module")
def daemon_settings(net: Net) -> dict[str, str]:
    hosts = {"web.test": net.web, "other.test": net.other, "git.test": net.git}
    return {
        "pool_size": "1",
        "egress_hosts": json.dumps({**hosts, "api.test": "127.0.0.1"}),
        # tenants may open web's address
        "egress_tenant_networks": json.dumps([f"{net.web}/32"]),
        "egress_upstream_ca": str(net.ca.cert),
    }


def sh(sb: Sandbox, command: str, timeout: float = 60) -> tuple[int, str, str]:
    r = sb.exec(command, timeout=timeout)
    return r.exit_code, r.stdout.decode(), r.stderr.decode()


def with_test_ca(sb: Sandbox, net: Net) -> Sandbox:
    """The guest trusts the test servers' CA for connections that pass through untouched."""
    sb.files.write(GUEST_TEST_CA, net.ca.cert.read_bytes())
    return sb


def decisions(sb: Sandbox, settle: float = 5.0) -> list[dict[str, object]]:
    """The decision log; an allowed exchange is reported when it ends, so wait a little."""
    deadline = time.monotonic() + settle
    while True:
        log = [d.model_dump() for d in sb.egress()]
        if time.monotonic() > deadline or log:
            return log
        time.sleep(0.1)


def wait_for(sb: Sandbox, predicate: object, timeout: float = 5.0) -> list[dict[str, object]]:
    deadline = time.monotonic() + timeout
    while True:
        log = [d.model_dump() for d in sb.egress()]
        if any(predicate(d) for d in log) or time.monotonic() > deadline:  # type: ignore[operator]
            return log
        time.sleep(0.1)


def test_a_new_sandbox_reaches_nothing(admin: Client, net: Net, daemon: Daemon) -> None:
    """Every way out of a sandbox without rules is refused by the proxy itself, and the
    guest has no other door; the control is a sandbox whose rules open exactly these paths,
    running the same probes, which get through."""
    api_port = daemon.port
    neighbour = admin.create()
    victim = admin.create()  # no rules: default deny
    # the control reaches the host's loopback only through the operator's doors: a name in
    # its host table, an address in the network it lets tenants open
    control = admin.create(allow=reach.control_rules(net.web, api_port))
    try:
        reach.serve_marker(neighbour)
        exposed = neighbour.expose(8000, expires_in_seconds=600)
        # (the victim's probe, the control's probe of the same server)
        pairs = reach.doors(net.web, api_port, exposed)
        pairs["a name, transparently"] = (["direct", "http://web.test/reach"],) * 2
        through_proxy = {k: v[0] for k, v in pairs.items()}
        # no other door in the guest: (probe, control on the same kind of socket)
        local: dict[str, tuple[reach.Target, reach.Target]] = {
            "unserved TCP port of the egress address": (
                ["tcp", reach.EGRESS, 22],
                ["tcp", reach.EGRESS, 3128],
            ),
            "UDP to the egress address": (["udp", reach.EGRESS, 53], ["udp", "127.0.0.53", 53]),
        }
        before = len(net.web_seen.requests)
        refused = reach.probe(victim, through_proxy | {k: v[0] for k, v in local.items()})
        print(json.dumps(refused, indent=1))
        for name in through_proxy:
            assert refused[name].startswith("denied 403"), (name, refused[name])
            assert "cella egress" in refused[name], (name, refused[name])
        for name in local:
            assert refused[name].startswith("blocked"), (name, refused[name])
        assert len(net.web_seen.requests) == before  # nothing reached a server
        opened = reach.probe(
            control, {k: v[1] for k, v in pairs.items()} | {k: v[1] for k, v in local.items()}
        )
        print(json.dumps(opened, indent=1))
        for name, result in opened.items():
            assert result.startswith("open"), (name, result)
        assert "neighbour-marker" in opened["the neighbour's server by its service URL"]
        assert len(net.web_seen.requests) == before + 3
        assert sh(neighbour, "cat /srv/m")[1].strip() == "neighbour-marker"
        log = wait_for(victim, lambda d: d["host"] == "127.0.0.1" and d["port"] == api_port)
        denied = {(d["host"], d["port"]): d["reason"] for d in log if not d["allowed"]}
        assert denied[("web.test", 80)] == "no rule allows it"
        assert "address rule" in str(denied[(net.web, 80)])
        assert ("127.0.0.1", api_port) in denied
        assert not any(d["allowed"] for d in log)
    finally:
        for sb in (neighbour, victim, control):
            sb.delete()


def test_allowed_domain_via_proxy_and_transparently(admin: Client, net: Net) -> None:
    with admin.create(allow=["web.test"]) as sb:
        with_test_ca(sb, net)
        code, out, _ = sh(sb, "curl -sSf http://web.test/via-proxy")
        assert code == 0 and json.loads(out)["path"] == "/via-proxy"
        code, out, _ = sh(sb, "curl -sSf --noproxy '*' http://web.test/transparent")
        assert code == 0 and json.loads(out)["headers"]["host"] == "web.test"
        # TLS to a host no secret is bound to passes through: the guest sees the server's
        # own certificate (it verifies against the test CA alone)
        for flags in ("", "--noproxy '*'"):
            code, out, err = sh(
                sb, f"curl -sSf {flags} --cacert {GUEST_TEST_CA} https://web.test/tls"
            )
            assert code == 0, err
            assert json.loads(out)["path"] == "/tls"
        # tools that ignore the proxy variables resolve every name to the proxy address
        code, out, _ = sh(sb, "getent hosts web.test anything.example")
        assert out.split() == ["10.0.2.100", "web.test", "10.0.2.100", "anything.example"]

        code, out, _ = sh(
            sb, "curl -sS http://other.test/x; curl -sS --noproxy '*' http://other.test/y"
        )
        assert out.count("denied: no rule allows it") == 2
        # the allowed name's address is not a way around the rules
        code, out, _ = sh(sb, f"curl -sS http://{net.web}/raw")
        assert "only by an address rule" in out
        code, _, _ = sh(sb, f"curl -sS -m 5 --noproxy '*' http://{net.web}/raw")
        assert code != 0
        code, _, err = sh(
            sb, f"curl -sS --noproxy '*' --cacert {GUEST_TEST_CA} https://other.test/"
        )
        assert code != 0, err
        assert [r["path"] for r in net.other_seen.requests] == []

        log = wait_for(sb, lambda d: d["host"] == "web.test" and d["port"] == 443)
        allowed = [d for d in log if d["allowed"]]
        assert {(d["host"], d["port"]) for d in allowed} == {("web.test", 80), ("web.test", 443)}
        assert all(int(str(d["bytes_in"])) > 0 for d in allowed)
        assert any(d["protocol"] == "tls-passthrough" for d in allowed)
        denied = [d for d in log if not d["allowed"]]
        assert {(d["host"], d["port"]) for d in denied} >= {("other.test", 80), ("other.test", 443)}

        # a live change: deny wins over a wildcard, then other.test is let in
        sb.set_network(allow=["*.test"], deny=["other.test"])
        assert "denied by rule other.test" in sh(sb, "curl -sS http://other.test/z")[1]
        assert json.loads(sh(sb, "curl -sSf http://web.test/w")[1])["path"] == "/w"
        sb.set_network(allow=["web.test", "other.test:80"])
        assert json.loads(sh(sb, "curl -sSf http://other.test/now")[1])["path"] == "/now"
        code, _, err = sh(sb, f"curl -sS --cacert {GUEST_TEST_CA} https://other.test/")
        assert code != 0 and "403" in err  # port 443 is not in the rule: CONNECT refused
        # an address rule opens the raw IP
        sb.set_network(allow=[f"{net.web}/32:80"])
        assert json.loads(sh(sb, f"curl -sSf http://{net.web}/ip")[1])["path"] == "/ip"
        assert sb.refresh().info.network.allow == [f"{net.web}/32:80"]


def test_policy_is_validated(admin: Client) -> None:
    from cella import errors

    for bad in (["**"], ["exa mple.com"], ["a.com:0"], ["a.com:99999"], ["*.*.com"]):
        with pytest.raises(errors.InvalidArgument):
            admin.create(allow=bad)
    with pytest.raises(errors.InvalidArgument, match="no secret"):
        admin.create(secrets={"TOKEN": "missing"})
    with pytest.raises(errors.InvalidArgument):
        admin.put_secret("bad", "v", ["a.com:443"])


def test_secret_reaches_only_its_hosts(admin: Client, net: Net, daemon: Daemon) -> None:
    stored = admin.put_secret("api", SECRET, ["web.test"])
    assert SECRET not in stored.model_dump_json()
    assert all(SECRET not in s.model_dump_json() for s in admin.secrets())
    with admin.create(allow=["web.test", "other.test"], secrets={"API_TOKEN": "api"}) as sb:
        with_test_ca(sb, net)
        placeholder = sh(sb, 'printf %s "$API_TOKEN"')[1]
        assert placeholder.startswith("cella-secret-") and SECRET not in placeholder
        auth = '-H "Authorization: Bearer $API_TOKEN"'

        # to the bound host: headers, query and body carry the real value (TLS intercepted
        # with the deployment CA the guest trusts)
        before = len(net.web_seen.requests)
        code, out, err = sh(
            sb, f'curl -sSf {auth} "https://web.test/s?key=$API_TOKEN" -d "t=$API_TOKEN"'
        )
        assert code == 0, err
        code, out2, _ = sh(sb, f"curl -sSf --noproxy '*' {auth} http://web.test/plain")
        assert code == 0
        seen = net.web_seen.requests[before:]
        assert [r["headers"]["authorization"] for r in seen] == [f"Bearer {SECRET}"] * 2
        assert seen[0]["path"] == f"/s?key={SECRET}" and seen[0]["body"] == f"t={SECRET}"
        # the server echoed it back; what reached the guest holds the placeholder again
        echoed = json.loads(out)
        assert echoed["headers"]["authorization"] == f"Bearer {placeholder}"
        assert SECRET not in out + out2

        # to any other host the placeholder stays a placeholder
        before = len(net.other_seen.requests)
        code, out, err = sh(
            sb, f'curl -sSf {auth} --cacert {GUEST_TEST_CA} "https://other.test/o?k=$API_TOKEN"'
        )
        assert code == 0, err
        code, out, _ = sh(sb, f"curl -sSf {auth} http://other.test/o2")
        assert code == 0
        seen_other = net.other_seen.requests[before:]
        assert len(seen_other) == 2
        assert all(r["headers"]["authorization"] == f"Bearer {placeholder}" for r in seen_other)
        assert SECRET not in json.dumps(seen_other)

        # the value is nowhere in the guest
        dirs = "/etc /root /tmp /home /run /var/tmp /usr/local"
        code, out, _ = sh(
            sb,
            f"env; cat /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n'; "
            # split in two so the command itself (kept in the exec event) does not hold it
            f"grep -rIl -- '{SECRET[:6]}''{SECRET[6:]}' {dirs} 2>/dev/null; true",
        )
        assert SECRET not in out and placeholder in out
        log = wait_for(sb, lambda d: d.get("credentials") == ["api"])
        assert any(d["host"] == "web.test" and d["credentials"] == ["api"] for d in log)
        assert not any(d["host"] == "other.test" and d["credentials"] for d in log)
        assert SECRET not in json.dumps([e.model_dump(mode="json") for e in sb.events()])
    assert SECRET not in (daemon.data_dir / "daemon.log").read_text()
    assert SECRET not in (daemon.data_dir / "egress" / "proxy.log").read_text()


def test_git_clone_and_push_with_a_token_the_guest_never_sees(admin: Client, net: Net) -> None:
    admin.put_secret("gh", GIT_TOKEN, ["git.test"], auth="basic")
    with admin.create(allow=["git.test"], secrets={"GH_TOKEN": "gh"}) as sb:
        code, out, err = sh(
            sb,
            "git clone -q https://git.test/repo.git /work/repo && cat /work/repo/README",
            timeout=120,
        )
        assert code == 0, err
        assert out == "seeded\n"
        code, out, err = sh(
            sb,
            "cd /work/repo && git -c user.name=agent -c user.email=a@b commit -q --allow-empty "
            "-m 'from the sandbox' && git push -q origin HEAD:main",
            timeout=120,
        )
        assert code == 0, err
        log = subprocess.run(
            ["git", "--git-dir", str(net.git_root / "repo.git"), "log", "--format=%s", "main"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        assert log.splitlines()[0] == "from the sandbox"
        _, config, _ = sh(sb, "cat /work/repo/.git/config; git config --list --show-origin; env")
        assert GIT_TOKEN not in config
        assert "x-access-token" not in config
        expected = "Basic " + base64.b64encode(f"x-access-token:{GIT_TOKEN}".encode()).decode()
        assert net.git_seen.requests
        assert all(r["authorization"] == expected for r in net.git_seen.requests)


def test_the_proxy_is_restarted_and_survives_a_daemon_crash(
    admin: Client, net: Net, daemon: Daemon
) -> None:
    sb = admin.create(allow=["web.test"])
    assert sh(sb, "curl -sSf http://web.test/one")[0] == 0
    proxy = _proxy_pid(daemon.data_dir)
    os.kill(proxy, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while True:  # the supervisor starts it again with every sandbox's policy
        code, out, _ = sh(sb, "curl -sSf http://web.test/two")
        if code == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert code == 0 and json.loads(out)["path"] == "/two"
    assert _proxy_pid(daemon.data_dir) != proxy

    daemon.kill9()  # the proxy dies with it; the VM does not
    daemon.start()
    with daemon.client() as again:
        adopted = again.get(sb.id)
        code, out, err = sh(adopted, "curl -sSf http://web.test/three")
        assert code == 0, err
        assert "denied" in sh(adopted, "curl -sS http://other.test/")[1]
        adopted.delete()


def _proxy_pid(data_dir: Path) -> int:
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if (
                any(a.endswith(b"mitmdump") for a in argv)
                and f"confdir={data_dir}/egress".encode() in argv
            ):
                return int(entry)
    raise AssertionError("no egress proxy running")


def test_egress_through_the_cli(daemon: Daemon, admin: Client, net: Net) -> None:
    def cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "cella.cli", *args],
            env=daemon.env(None),
            input=stdin,
            capture_output=True,
            text=True,
            timeout=300,
        )

    made = cli(
        "secret", "set", "cli-token", "--host", "web.test", "--auth", "bearer", stdin="v-cli-77\n"
    )
    assert made.returncode == 0, made.stderr
    listed = cli("secret", "ls", "--json")
    assert "cli-token" in listed.stdout and "v-cli-77" not in listed.stdout
    created = cli(
        "sandbox", "create", "--allow", "other.test", "--secret", "TOK=cli-token", "--json"
    )
    assert created.returncode == 0, created.stderr
    info = json.loads(created.stdout)
    assert info["network"]["allow"] == ["other.test"] and info["secrets"] == {"TOK": "cli-token"}
    sandbox_id = info["id"]
    try:
        assert (
            cli("sandbox", "exec", sandbox_id, "--", "curl", "-sSf", "http://web.test/").returncode
            != 0
        )
        changed = cli("sandbox", "network", sandbox_id, "--allow", "web.test", "--json")
        assert json.loads(changed.stdout) == {
            "allow": ["web.test"],
            "deny": [],
            "headers": [],
            "aws": [],
            "gcp": [],
            "env": {},
            "callbacks": [],
            "rewrites": [],
            "public_ports": False,
            "identity_tokens": {},
            "upstream_proxy": None,
            "port_host": None,
        }
        before = len(net.web_seen.requests)
        ran = cli("sandbox", "exec", sandbox_id, "--", "curl", "-sSf", "http://web.test/cli")
        assert ran.returncode == 0, ran.stderr
        assert net.web_seen.requests[before]["headers"]["authorization"] == "Bearer v-cli-77"
        log = json.loads(cli("sandbox", "egress", sandbox_id, "--json").stdout)
        assert [(d["host"], d["allowed"]) for d in log][:1] == [("web.test", False)]
        table = cli("sandbox", "egress", sandbox_id)
        assert "deny" in table.stdout and "web.test" in table.stdout
        assert cli("secret", "rm", "cli-token").returncode == 0
        assert "cli-token" not in cli("secret", "ls", "--json").stdout
    finally:
        admin.get(sandbox_id).delete()


def test_forks_and_resumes_keep_the_policy(admin: Client, net: Net) -> None:
    with admin.create(allow=["web.test"]) as sb:
        # a connection held open across the snapshot: its forks must still start
        sb.exec(
            'python3 -c \'import socket,time; s=socket.create_connection(("10.0.2.100", 80)); '
            "time.sleep(600)' >/dev/null 2>&1 &"
        )
        time.sleep(0.5)
        branches = sb.fork(2)
        try:
            for branch in branches:
                assert branch.info.network.allow == ["web.test"]
                code, out, err = sh(branch, f"curl -sSf http://web.test/{branch.id}")
                assert json.loads(out)["path"] == f"/{branch.id}"
                assert code == 0, err
                assert "denied" in sh(branch, "curl -sS http://other.test/")[1]
            branches[0].set_network(allow=["other.test"])  # a branch's rules are its own
            assert sh(branches[0], "curl -sSf http://other.test/")[0] == 0
            assert "denied" in sh(branches[1], "curl -sS http://other.test/")[1]
            assert "denied" in sh(sb, "curl -sS http://other.test/")[1]
        finally:
            for branch in branches:
                branch.delete()
        sb.stop()
        sb.resume()  # a new VM, a new source address: the same rules
        assert sh(sb, "curl -sSf http://web.test/after-resume")[0] == 0
        assert "denied" in sh(sb, "curl -sS http://other.test/")[1]


def test_secrets_are_sealed_at_rest_and_work_after_rotation(
    admin: Client, net: Net, daemon: Daemon
) -> None:
    admin.put_secret("sealed", SECRET, ["web.test"])
    data = daemon.data_dir
    raw = b"".join(p.read_bytes() for p in data.glob("cella.db*"))
    assert b"web.test" in raw and SECRET.encode() not in raw  # the row is there, sealed
    key = (data / "secrets.key").read_bytes()
    assert admin.rotate_secrets_key() >= 1
    assert (data / "secrets.key").read_bytes() != key
    # the value still reaches its host: the proxy got it from the resealed row
    with admin.create(allow=["web.test"], secrets={"TOKEN": "sealed"}) as sb:
        with_test_ca(sb, net)
        before = len(net.web_seen.requests)
        auth = '-H "Authorization: Bearer $TOKEN"'
        code, _, err = sh(sb, f"curl -sSf --noproxy '*' {auth} http://web.test/after-rotation")
        assert code == 0, err
        assert net.web_seen.requests[before]["headers"]["authorization"] == f"Bearer {SECRET}"
    admin.delete_secret("sealed")
