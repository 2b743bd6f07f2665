"""Upgrades keep work: a daemon of this release starts on a data directory the previous
release wrote while it ran, and adopts the VMs that release left running, their egress
(with its sealed secret) working. The previous release is the pinned commit below, taken
out of this repository with `git archive` and run as a daemon with its own PYTHONPATH."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cella import __version__
from tests.daemon import DaemonFactory
from tests.netservers import EchoHandler, Recorder, Servers, free_loopback_block
from tests.vms import qemu_pids

pytestmark = pytest.mark.vm

PREVIOUS = "72e18ee"  # the last commit of release 0.1.0 (the next one made it 0.2.0)
REPO = Path(__file__).resolve().parents[2]
SECRET = "upgrade-s3cr3t-4e1d"


@pytest.fixture(scope="module")
def previous(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The previous release's source tree (its `src`, to put on a daemon's PYTHONPATH)."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs this repository's history (a git checkout)")
    known = ["git", "-C", str(REPO), "cat-file", "-e", f"{PREVIOUS}^{{commit}}"]
    if subprocess.run(known, capture_output=True).returncode != 0:
        pytest.skip(f"needs this repository's history back to {PREVIOUS} (a shallow clone?)")
    out = tmp_path_factory.mktemp("previous")
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", "--format=tar", PREVIOUS, "src"],
        capture_output=True,
        check=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    return out / "src"


@pytest.fixture(scope="module")
def previous_images(previous: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An image directory for the previous release: this host's kernel, egress proxy and
    `default` base, the base under the name that release's build gives it (a later release
    may build the same template by other steps, under another name)."""
    from cella.images.templates import builtin_templates, template_image
    from cella.paths import Paths

    shared = Paths.default()
    images = tmp_path_factory.mktemp("previous-images")
    name = subprocess.run(
        [
            sys.executable,
            "-c",
            "from pathlib import Path; from cella.paths import Paths; "
            "from cella.images.templates import builtin_templates, template_image; "
            f"print(template_image(Paths(Path('/'), Path({str(images)!r})), "
            "builtin_templates()['default']).name)",
        ],
        env={**os.environ, "PYTHONPATH": str(previous)},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    base = template_image(shared, builtin_templates()["default"])
    (images / "templates").mkdir()
    for src, dest in ((base, name), (base.with_suffix(".json"), name.replace(".qcow2", ".json"))):
        try:
            os.link(src, images / "templates" / dest)
        except OSError:
            shutil.copy2(src, images / "templates" / dest)
    shutil.copytree(shared.kernel, images / "kernel")
    (images / "egress").symlink_to(shared.images / "egress")
    return images


@pytest.fixture(scope="module")
def web() -> Iterator[tuple[str, Recorder]]:
    prefix = free_loopback_block()
    servers = Servers()
    seen = servers.start(EchoHandler, (f"{prefix}.1", 80))
    servers.start(EchoHandler, (f"{prefix}.2", 80))
    yield prefix, seen
    servers.close()


class Held:
    """A server that takes connections and never answers (a slow upstream)."""

    def __init__(self, address: tuple[str, int]) -> None:
        self.listener = socket.create_server(address)
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                self.held.append(self.listener.accept()[0])

    def close(self) -> None:
        self.listener.close()
        for conn in self.held:
            conn.close()


def vms_of(data_dir: Path) -> set[int]:
    from cella.runtime.qemu.vm import qemu_cmdline

    return {p for p in qemu_pids() if f"{data_dir}/vms/" in " ".join(qemu_cmdline(p))}


def wait_for_loop(seen: Recorder, timeout: float = 20.0) -> bool:
    """Whether the guest's loop reaches the server again within `timeout`."""
    before = sum(r["path"] == "/loop" for r in seen.requests)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sum(r["path"] == "/loop" for r in seen.requests) > before:
            return True
        time.sleep(0.2)
    return False


def sh(sandbox: object, command: str) -> tuple[int, str, str]:
    result = sandbox.exec(command, timeout=60)  # type: ignore[attr-defined]
    return result.exit_code, result.stdout.decode(), result.stderr.decode()


def test_this_release_adopts_what_the_previous_one_left_running(
    previous: Path,
    previous_images: Path,
    web: tuple[str, Recorder],
    daemon_factory: DaemonFactory,
) -> None:
    prefix, seen = web
    settings = {
        "pool_size": "0",
        "egress_hosts": json.dumps({"web.test": f"{prefix}.1", "other.test": f"{prefix}.2"}),
    }
    old = daemon_factory(
        "upgrade",
        wrap=["env", f"PYTHONPATH={previous}"],
        image_dir=str(previous_images),
        **settings,
    )
    with old.client() as client:
        health = client.request("GET", "/v1/health").json()
        assert health.get("version") != __version__  # the previous release's code serves
        tenant_key = client.create_key("acme")["key"]
        client.put_secret("token", SECRET, ["web.test"], auth="bearer")
        sb = client.create(allow=["web.test"], secrets={"TOKEN": "token"})
        sb.files.write("/workspace/old.txt", "made by the previous release")
        sb.exec("nohup sleep 1000 >/dev/null 2>&1 &")
        assert sh(sb, "curl -sSf http://web.test/before")[0] == 0
        # a paused one whose guest calls out on its own (no exec from the host after it
        # is resumed): the calls reach the server before the upgrade...
        napper = client.create(allow=["web.test"])
        napper.exec(
            "nohup sh -c 'while :; do curl -s -m 3 http://web.test/loop >/dev/null; "
            "sleep 0.3; done' >/dev/null 2>&1 &"
        )
        assert wait_for_loop(seen), "the guest's own calls never arrived"
        napper.pause()
        pids = vms_of(old.data_dir)
        assert len(pids) == 2
    old.stop()  # a graceful stop, as an upgrade's: sandbox VMs keep running
    assert vms_of(old.data_dir) == pids

    new = daemon_factory("upgraded", data_dir=old.data_dir, **settings)
    with new.client() as client:
        adopted = client.get(sb.id)
        assert adopted.state == "running"
        assert vms_of(new.data_dir) == pids  # the same QEMU: adopted, not rebooted
        assert "adopted" in [e.type for e in adopted.events()]
        assert adopted.exec(["pgrep", "-x", "sleep"]).exit_code == 0
        assert adopted.files.read("/workspace/old.txt") == b"made by the previous release"
        # egress works at once, through the proxy and transparently, with the secret the
        # old daemon sealed swapped in toward its host
        before = len(seen.requests)
        code, out, err = sh(adopted, "curl -sSf http://web.test/after")
        assert code == 0, err
        assert json.loads(out)["path"] == "/after"
        code, _, err = sh(adopted, "curl -sSf --noproxy '*' http://web.test/transparent")
        assert code == 0, err
        assert [r["headers"]["authorization"] for r in seen.requests[before:]] == [
            f"Bearer {SECRET}"
        ] * 2
        # control: a host its rules do not allow is still refused
        code, out, _ = sh(adopted, "curl -sS http://other.test/")
        assert "denied" in out
        # the key the old daemon made still works
        with new.client(tenant_key) as tenant:
            assert tenant.list() == []
        adopted.delete()
        # ...and after it: the paused VM is adopted, resumed, and its guest's calls get
        # through without the host sending it anything first
        woken = client.get(napper.id)
        assert woken.state == "paused"
        woken.resume()
        assert wait_for_loop(seen), "the adopted guest's own calls no longer get out"
        woken.delete()
    assert vms_of(new.data_dir) == set()


def test_connections_open_across_a_restart_end_instead_of_hanging(
    web: tuple[str, Recorder], daemon_factory: DaemonFactory
) -> None:
    """A guest's call in flight when its daemon goes away can never be answered (its host
    end went with the daemon): the agent ends it, so the program sees an error and may try
    again, rather than waiting for an answer that cannot come."""
    prefix = web[0]
    held = Held((f"{prefix}.3", 80))
    hosts = {"web.test": f"{prefix}.1", "held.test": f"{prefix}.3"}
    daemon = daemon_factory("restart", pool_size="0", egress_hosts=json.dumps(hosts))
    try:
        with daemon.client() as client:
            sb = client.create(allow=["web.test", "held.test"])
            sb.exec(
                "nohup sh -c 'curl -sS -m 300 http://held.test/; echo $? > /tmp/held.rc' "
                ">/dev/null 2>&1 &"
            )
            deadline = time.monotonic() + 30
            while not held.held:  # the call is under way: the proxy has connected upstream
                assert time.monotonic() < deadline, "the call never reached the server"
                time.sleep(0.1)
            assert not sb.files.exists("/tmp/held.rc")  # control: it waits
        daemon.stop()
        daemon.start()
        with daemon.client() as client:
            adopted = client.get(sb.id)
            deadline = time.monotonic() + 30
            while not adopted.files.exists("/tmp/held.rc"):
                assert time.monotonic() < deadline, "the call still waits for its dead host end"
                time.sleep(0.2)
            assert adopted.files.read("/tmp/held.rc").strip() != b"0"
            code, out, err = sh(adopted, "curl -sSf http://web.test/again")  # a new call works
            assert code == 0, err
            assert json.loads(out)["path"] == "/again"
            adopted.delete()
    finally:
        held.close()
