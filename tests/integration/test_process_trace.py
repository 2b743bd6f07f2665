"""The process trace end to end: real microVMs whose agent reads the kernel's process events,
a real daemon, and real connections through the egress proxy to servers on loopback."""

from __future__ import annotations

import base64
import hashlib
import http.server
import io
import json
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from cella import Client, Sandbox
from cella.models import ExecDefaults
from cella.models.proctree import ExecTree, ProcessNode
from tests.daemon import Daemon
from tests.netservers import EchoHandler, Servers, free_loopback_block

pytestmark = pytest.mark.vm

LIMIT = 300  # processes of one command recorded in full, here


@dataclass
class Net:
    web: str
    other: str
    index: str  # a package index (PEP 503) serving one wheel


def _wheel() -> tuple[str, bytes]:
    """A pure-Python wheel of `tinypkg` 1.0, made here (nothing comes from the internet)."""
    files = {
        "tinypkg/__init__.py": b"VALUE = 42\n",
        "tinypkg-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: tinypkg\nVersion: 1.0\n",
        "tinypkg-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: tests\n"
        b"Root-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(
        f"{name},sha256={_b64(hashlib.sha256(data).digest())},{len(data)}\n"
        for name, data in files.items()
    )
    files["tinypkg-1.0.dist-info/RECORD"] = (record + "tinypkg-1.0.dist-info/RECORD,,\n").encode()
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return "tinypkg-1.0-py3-none-any.whl", out.getvalue()


def _b64(digest: bytes) -> str:
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


class IndexHandler(http.server.BaseHTTPRequestHandler):
    """/simple/tinypkg/ links the wheel, /files/NAME serves it."""

    wheel: tuple[str, bytes]

    def do_GET(self) -> None:
        name, data = self.wheel
        if self.path.rstrip("/") == "/simple/tinypkg":
            digest = hashlib.sha256(data).hexdigest()
            body = f'<a href="/files/{name}#sha256={digest}">{name}</a>'.encode()
            kind = "text/html"
        elif self.path == f"/files/{name}":
            body, kind = data, "application/octet-stream"
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def net() -> Iterator[Net]:
    prefix = free_loopback_block()
    web, other, index = f"{prefix}.1", f"{prefix}.2", f"{prefix}.3"
    servers = Servers()
    servers.start(EchoHandler, (web, 80))
    servers.start(EchoHandler, (other, 80))
    servers.start(IndexHandler, (index, 80), wheel=_wheel())
    yield Net(web, other, index)
    servers.close()


@pytest.fixture(scope="module")
def daemon_settings(net: Net) -> dict[str, str]:
    return {
        "pool_size": "0",
        "egress_hosts": json.dumps(
            {"web.test": net.web, "other.test": net.other, "pypi.test": net.index}
        ),
        "trace_max_processes": str(LIMIT),
    }


@pytest.fixture(scope="module")
def sb(admin: Client) -> Iterator[Sandbox]:
    with admin.create(allow=["web.test", "other.test", "pypi.test"], max_pids=96) as sandbox:
        yield sandbox


def tree_of(sb: Sandbox, exec_id: int, done: bool = True, timeout: float = 20.0) -> ExecTree:
    """The exec's tree; with `done`, once every process it started has been reported gone
    (its summary is written then)."""
    deadline = time.monotonic() + timeout
    while True:
        trees = sb.process_trees(exec_id)
        assert len(trees) == 1
        if not done or trees[0].summary is not None or time.monotonic() > deadline:
            return trees[0]
        time.sleep(0.2)


def last_exec(sb: Sandbox) -> int:
    return sb.events(types=["exec"])[-1].id


def find(tree: ExecTree, argv0: str) -> list[ProcessNode]:
    return [n for n in tree.walk() if n.argv[:1] == [argv0]]


def test_a_pipeline_and_its_background_child(sb: Sandbox) -> None:
    script = (
        "echo abc | tr a-z A-Z; "
        "sleep 1.5 & "
        "sh -c 'cat /etc/hostname | wc -c; exit 7'; "
        "sh -c 'kill -TERM $$'; "
        "echo done"
    )
    r = sb.exec(["/bin/sh", "-c", script], cwd="/tmp")
    assert r.exit_code == 0 and r.stdout.decode().splitlines()[0] == "ABC"
    exec_id = last_exec(sb)

    # when the command ended, its background child was still running
    early = tree_of(sb, exec_id, done=False)
    (sleeper,) = find(early, "sleep")
    assert sleeper.state == "running" and sleeper.ended_at is None

    tree = tree_of(sb, exec_id)
    assert tree.summary is not None and tree.summary["truncated"] is False
    (root,) = tree.processes
    assert root.argv == ["/bin/sh", "-c", script]
    assert root.exit_code == 0 and root.signal is None and root.cwd == "/tmp"
    assert root.uid == 0 and root.started_at is not None and root.ended_at is not None
    by_argv = {tuple(n.argv): n for n in tree.walk()}
    tr = by_argv[("tr", "a-z", "A-Z")]
    inner = by_argv[("sh", "-c", "cat /etc/hostname | wc -c; exit 7")]
    cat, wc = by_argv[("cat", "/etc/hostname")], by_argv[("wc", "-c")]
    killed = by_argv[("sh", "-c", "kill -TERM $$")]
    (sleeper,) = find(tree, "sleep")
    # parents: the pipeline, the background child and both inner shells are the command's
    # children; cat and wc are the inner shell's
    assert {n.pid for n in root.children} >= {tr.pid, inner.pid, killed.pid, sleeper.pid}
    assert {n.pid for n in inner.children} == {cat.pid, wc.pid}
    assert all(n.ppid == root.pid for n in (tr, inner, killed, sleeper))
    assert cat.ppid == wc.ppid == inner.pid
    # exit codes and signals
    assert (tr.exit_code, inner.exit_code, cat.exit_code, wc.exit_code) == (0, 7, 0, 0)
    assert killed.signal == 15 and killed.exit_code is None
    assert sleeper.state == "exited" and sleeper.exit_code == 0
    # CPU time is read while a process is a zombie: always the command's own (the agent
    # reaps it), the others' when their parent had not reaped them yet
    assert root.cpu_ms is not None and root.cpu_ms >= 0
    assert all(n.cpu_ms is None or n.cpu_ms >= 0 for n in tree.walk())
    # the filter by exec returns this exec and what is under it, nothing else
    mine = sb.events(exec_id=exec_id)
    assert mine[0].id == exec_id and mine[0].type == "exec"
    assert {e.type for e in mine[1:]} == {"process", "process_summary"}
    assert all(e.data["parent"]["exec"] == exec_id for e in mine[1:])


def test_the_cli_prints_the_tree(sb: Sandbox, daemon: Daemon) -> None:
    sb.exec(["/bin/sh", "-c", "sh -c 'exit 5'; true"])
    exec_id = last_exec(sb)
    tree_of(sb, exec_id)

    def cella(*args: str) -> str:
        return subprocess.run(
            [sys.executable, "-m", "cella.cli", "trace", sb.id, *args],
            env=daemon.env(),
            capture_output=True,
            text=True,
            check=True,
        ).stdout

    text = cella("--tree", "--exec", str(exec_id))
    lines = text.splitlines()
    assert lines[0].startswith(f"exec {exec_id}: $ /bin/sh -c sh -c 'exit 5'; true")
    (inner,) = [line for line in lines if "sh -c exit 5" in line]
    assert "[exit 5]" in inner and inner.index("sh -c exit 5") > lines[1].index("/bin/sh")
    (tree,) = [
        json.loads(line) for line in cella("--tree", "--json", "--exec", str(exec_id)).splitlines()
    ]
    assert tree["exec_id"] == exec_id
    assert tree["processes"][0]["children"][0]["argv"] == ["sh", "-c", "exit 5"]


def test_a_fork_bomb_is_counted_not_recorded(sb: Sandbox, daemon: Daemon) -> None:
    answers: list[int] = []
    stop = threading.Event()

    def ask_health() -> None:
        with httpx.Client(base_url=daemon.url, timeout=10) as http:
            while not stop.is_set():
                answers.append(http.get("/v1/health").status_code)
                time.sleep(0.5)

    watcher = threading.Thread(target=ask_health)
    watcher.start()
    try:
        # four loops forking for ever, and a classic bomb that fills the pid limit; the
        # command itself then waits without a fork until its timeout kills the whole tree
        bomb = (
            "for i in 1 2 3 4; do (while :; do /bin/true; done) 2>/dev/null & done; "
            "bomb() { bomb | bomb & }; bomb 2>/dev/null; exec sleep 30"
        )
        r = sb.exec(["/bin/sh", "-c", bomb], timeout=12)
    finally:
        stop.set()
        watcher.join()
    assert r.timed_out
    assert answers and set(answers) == {200}  # the daemon answered all along
    tree = tree_of(sb, last_exec(sb), timeout=60)
    summary = tree.summary
    assert summary is not None and summary["truncated"] is True
    assert summary["recorded"] == LIMIT
    assert summary["total"] == summary["recorded"] + summary["dropped"] > LIMIT
    assert len(tree.walk()) <= LIMIT
    # the sandbox is usable afterwards, and its next command is traced in full (control)
    assert sb.exec("true").exit_code == 0
    after = tree_of(sb, last_exec(sb))
    assert after.summary is not None and after.summary["truncated"] is False
    assert [n.argv for n in after.walk()] == [["/bin/sh", "-c", "true"]] or [
        n.argv for n in after.walk()
    ] == [["true"]]


def test_connections_name_the_process_that_opened_them(sb: Sandbox) -> None:
    script = (
        "curl -sSf http://web.test/from-curl >/dev/null; "
        "python3 -c \"import urllib.request as u; u.urlopen('http://other.test/from-python')\""
    )
    r = sb.exec(["/bin/sh", "-c", script])
    assert r.exit_code == 0, r.stderr
    exec_id = last_exec(sb)
    deadline = time.monotonic() + 10
    while True:
        log = [e.data for e in sb.events(types=["egress"]) if "process" in e.data]
        hosts = {d["host"] for d in log if d["process"]["exec"] == exec_id and "bytes_in" in d}
        if hosts >= {"web.test", "other.test"} or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    tree = tree_of(sb, exec_id)
    (curl,) = find(tree, "curl")
    (python,) = find(tree, "python3")
    web = [d for d in log if d["host"] == "web.test" and d["process"]["exec"] == exec_id]
    other = [d for d in log if d["host"] == "other.test" and d["process"]["exec"] == exec_id]
    assert web and other
    assert all(d["allowed"] and d["process"]["pid"] == curl.pid for d in web)
    assert web[0]["process"]["argv"] == ["curl", "-sSf", "http://web.test/from-curl"]
    # the control: the second process's connection is its own, not curl's
    assert all(d["process"]["pid"] == python.pid != curl.pid for d in other)
    assert other[0]["process"]["argv"][0] == "python3"
    # the tree carries each connection under its process, with bytes and duration
    (conn,) = [c for c in curl.connections if "bytes_in" in c]
    assert conn["host"] == "web.test" and conn["bytes_in"] > 0 and conn["duration_ms"] >= 0
    assert any(c["host"] == "other.test" for c in python.connections)
    assert "client_port" not in conn  # the daemon's own port is not the tenant's business


def test_pip_install_shows_the_files_it_wrote_and_its_connection(sb: Sandbox) -> None:
    pip = (
        "python3 -m pip install --user --break-system-packages --no-cache-dir -q "
        "--index-url http://pypi.test/simple/ --trusted-host pypi.test tinypkg"
    )
    r = sb.exec(["/bin/sh", "-c", f"{pip} && curl -sSf http://web.test/after-pip >/dev/null"])
    assert r.exit_code == 0, r.stderr
    exec_id = last_exec(sb)
    # the files pip wrote, under the command that ran it
    (changes,) = [e.data for e in sb.events(types=["file_changes"]) if e.data["parent"] == exec_id]
    created = {c["path"]: c for c in changes["changes"] if c["change"] == "created"}
    init = [p for p in created if p.endswith("site-packages/tinypkg/__init__.py")]
    assert init and created[init[0]]["size"] == len(b"VALUE = 42\n"), sorted(created)
    assert any(p.endswith("tinypkg-1.0.dist-info/RECORD") for p in created)
    assert sb.exec("python3 -c 'import tinypkg; print(tinypkg.VALUE)'").stdout == b"42\n"
    # the index's connections are pip's; the control: curl's, in the same command, is curl's
    deadline = time.monotonic() + 10
    while True:
        log = [e.data for e in sb.events(types=["egress"]) if "process" in e.data]
        mine = [d for d in log if d["process"]["exec"] == exec_id and "bytes_in" in d]
        if {d["host"] for d in mine} >= {"pypi.test", "web.test"} or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    index = [d for d in mine if d["host"] == "pypi.test"]
    web = [d for d in mine if d["host"] == "web.test"]
    assert index and web
    assert all(d["process"]["argv"][:3] == ["python3", "-m", "pip"] for d in index)
    pips = {n.pid for n in find(tree_of(sb, exec_id), "python3") if n.argv[1:3] == ["-m", "pip"]}
    assert {d["process"]["pid"] for d in index} <= pips and pips
    (curl,) = find(tree_of(sb, exec_id), "curl")
    assert all(d["process"]["pid"] == curl.pid not in pips for d in web)


def test_tracing_can_be_switched_off(admin: Client) -> None:
    with admin.create(exec_defaults=ExecDefaults(trace_processes=False)) as quiet:
        assert quiet.exec("sh -c 'true; true'").exit_code == 0
        assert quiet.events(types=["process", "process_summary"]) == []
        assert quiet.process_trees() == []
