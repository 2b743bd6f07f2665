"""Upgrades keep work: a daemon of this release starts on a data directory the previous
release wrote while it ran, and adopts the VMs that release left running, their egress
(with its sealed secret) working. The previous release is the pinned commit below, taken
out of this repository with `git archive` and run as a daemon with its own PYTHONPATH."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.daemon import DaemonFactory
from tests.netservers import EchoHandler, Recorder, Servers, free_loopback_block
from tests.vms import qemu_pids

pytestmark = pytest.mark.vm

PREVIOUS = "2db9a78"  # the last commit before this release's upgrade work (0.2.0 dev line)
REPO = Path(__file__).resolve().parents[2]
SECRET = "upgrade-s3cr3t-4e1d"


@pytest.fixture(scope="module")
def previous(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The previous release's source tree (its `src`, to put on a daemon's PYTHONPATH)."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs this repository's history (a git checkout)")
    out = tmp_path_factory.mktemp("previous")
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", "--format=tar", PREVIOUS, "src"],
        capture_output=True,
        check=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    return out / "src"


@pytest.fixture(scope="module")
def web() -> Iterator[tuple[str, Recorder]]:
    prefix = free_loopback_block()
    servers = Servers()
    seen = servers.start(EchoHandler, (f"{prefix}.1", 80))
    servers.start(EchoHandler, (f"{prefix}.2", 80))
    yield prefix, seen
    servers.close()


def vms_of(data_dir: Path) -> set[int]:
    from cella.runtime.qemu.vm import qemu_cmdline

    return {p for p in qemu_pids() if f"{data_dir}/vms/" in " ".join(qemu_cmdline(p))}


def sh(sandbox: object, command: str) -> tuple[int, str, str]:
    result = sandbox.exec(command, timeout=60)  # type: ignore[attr-defined]
    return result.exit_code, result.stdout.decode(), result.stderr.decode()


def test_this_release_adopts_what_the_previous_one_left_running(
    previous: Path, web: tuple[str, Recorder], daemon_factory: DaemonFactory
) -> None:
    prefix, seen = web
    settings = {
        "pool_size": "0",
        "egress_hosts": json.dumps({"web.test": f"{prefix}.1", "other.test": f"{prefix}.2"}),
    }
    old = daemon_factory("upgrade", wrap=["env", f"PYTHONPATH={previous}"], **settings)
    with old.client() as client:
        tenant_key = client.create_key("acme")["key"]
        client.put_secret("token", SECRET, ["web.test"], auth="bearer")
        sb = client.create(allow=["web.test"], secrets={"TOKEN": "token"})
        sb.files.write("/workspace/old.txt", "made by the previous release")
        sb.exec("nohup sleep 1000 >/dev/null 2>&1 &")
        assert sh(sb, "curl -sSf http://web.test/before")[0] == 0
        pids = vms_of(old.data_dir)
        assert len(pids) == 1
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
    assert vms_of(new.data_dir) == set()
