"""The control plane end to end: a real daemon on loopback, real microVMs, the SDKs and CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx2
import pytest

from cella import AsyncClient, Client, errors
from tests.daemon import Daemon

pytestmark = pytest.mark.vm

PKG_FILES = {
    "/workspace/mypkg/pyproject.toml": (
        '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "mypkg"\nversion = "1.0"\n'
    ),
    "/workspace/mypkg/mypkg/__init__.py": "ANSWER = 42\n",
}
# offline: the guest has no network, so the package comes from its own file system
PIP_INSTALL = (
    "pip install -q --no-index --no-build-isolation --break-system-packages /workspace/mypkg"
)


def test_lifecycle_through_the_sync_sdk(admin: Client, daemon: Daemon) -> None:
    sb = admin.create(vcpus=1, memory_mib=512, labels={"suite": "sync"})
    assert sb.state == "running" and sb.info.accel in ("kvm", "tcg")
    disk = daemon.data_dir / "vms" / sb.id / "disk.qcow2"
    assert disk.exists()
    r = sb.exec(["uname", "-r"])
    assert r.exit_code == 0 and r.text.strip().endswith("-cella")
    for path, content in PKG_FILES.items():
        sb.files.write(path, content, parents=True)
    sb.exec(PIP_INSTALL, check=True, timeout=300)
    sb.files.write("/workspace/notes.txt", "survives a stop\n")
    sb.exec("sleep 1000 &")  # a process: stop ends it

    assert sb.stop().state == "stopped"
    with pytest.raises(errors.InvalidState):
        sb.exec(["true"])
    assert sb.resume().state == "running"

    assert sb.files.read("/workspace/notes.txt") == b"survives a stop\n"
    r = sb.exec(["python3", "-c", "import mypkg; print(mypkg.ANSWER)"], cwd="/")
    assert r.stdout == b"42\n"
    assert sb.exec("pgrep -x sleep").exit_code == 1  # processes did not survive
    assert [s.id for s in admin.list(labels={"suite": "sync"})] == [sb.id]
    assert admin.get(sb.id).info.labels == {"suite": "sync"}

    sb.delete()
    assert not disk.parent.exists()  # the disk is freed
    with pytest.raises(errors.NotFound):
        admin.get(sb.id)
    assert sb.id not in [s.id for s in admin.list()]


def test_streaming_and_events(admin: Client) -> None:
    with admin.create() as sb:
        events = list(sb.exec_stream("for i in 1 2 3; do echo $i; sleep 0.1; done; printf '\\377'"))
        assert events[0].type == "started" and events[-1].type == "exit"
        out = b"".join(e.bytes for e in events if e.type == "stdout")
        assert out == b"1\n2\n3\n\xff"
        r = sb.exec(["printf", "\\377\\376"])  # non-UTF-8 survives the JSON API
        assert r.stdout == b"\xff\xfe"
        kinds = [e.type for e in sb.events()]
        assert kinds[0] == "created" and kinds.count("exec") == 2
        sb_id = sb.id
    with pytest.raises(errors.NotFound):
        admin.get(sb_id)  # the context manager deleted it


async def test_lifecycle_through_the_async_sdk(daemon: Daemon) -> None:
    async with AsyncClient(daemon.url, daemon.admin_key) as client:
        sb = await client.create(labels={"suite": "async"})
        async with sb:
            await sb.files.write("/workspace/a.txt", b"async")
            r = await sb.exec("cat /workspace/a.txt")
            assert r.stdout == b"async"
            chunks = [e.bytes async for e in sb.exec_stream(["echo", "hi"]) if e.type == "stdout"]
            assert b"".join(chunks) == b"hi\n"
            await sb.stop()
            await sb.resume()
            assert await sb.files.read("/workspace/a.txt") == b"async"
        with pytest.raises(errors.NotFound):
            await client.get(sb.id)


def cli(daemon: Daemon, *args: str, key: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cella.cli", *args],
        env=daemon.env(key),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_lifecycle_through_the_cli(daemon: Daemon, tmp_path: object) -> None:
    from pathlib import Path

    tmp = Path(str(tmp_path))
    created = cli(daemon, "sandbox", "create", "--label", "suite=cli", "--json")
    assert created.returncode == 0, created.stderr
    sb_id = json.loads(created.stdout)["id"]
    ran = cli(daemon, "sandbox", "exec", sb_id, "--", "sh", "-c", "echo out; exit 3")
    assert ran.returncode == 3 and ran.stdout == "out\n"  # exits with the guest's code
    (tmp / "up.txt").write_text("from the host")
    up = cli(daemon, "sandbox", "cp", str(tmp / "up.txt"), f"{sb_id}:/workspace/up.txt")
    assert up.returncode == 0, up.stderr
    assert cli(daemon, "sandbox", "stop", sb_id).returncode == 0
    listed = json.loads(cli(daemon, "sandbox", "ls", "--json").stdout)
    assert {s["id"]: s["state"] for s in listed}[sb_id] == "stopped"
    assert cli(daemon, "sandbox", "resume", sb_id).returncode == 0
    down = cli(daemon, "sandbox", "cp", f"{sb_id}:/workspace/up.txt", str(tmp / "down.txt"))
    assert down.returncode == 0, down.stderr
    assert (tmp / "down.txt").read_text() == "from the host"
    got = json.loads(cli(daemon, "sandbox", "get", sb_id, "--json").stdout)
    assert got["state"] == "running" and got["labels"] == {"suite": "cli"}
    assert cli(daemon, "sandbox", "rm", sb_id).returncode == 0
    missing = cli(daemon, "sandbox", "get", sb_id)
    assert missing.returncode != 0 and "not_found" in missing.stderr


def test_snapshot_and_fork_through_the_cli(daemon: Daemon) -> None:
    sb_id = json.loads(cli(daemon, "sandbox", "create", "--json").stdout)["id"]
    assert cli(daemon, "sandbox", "pause", sb_id).returncode == 0
    assert cli(daemon, "sandbox", "resume", sb_id).returncode == 0
    forked = cli(daemon, "sandbox", "fork", sb_id, "-n", "2", "--json")
    assert forked.returncode == 0, forked.stderr
    branches = json.loads(forked.stdout)
    assert len(branches) == 2 and all(b["parent_id"] == sb_id for b in branches)
    snaps = json.loads(cli(daemon, "snapshot", "ls", "--json").stdout)
    (snap,) = [s for s in snaps if s["sandbox_id"] == sb_id]
    refused = cli(daemon, "snapshot", "rm", snap["id"])
    assert refused.returncode == 1 and "in_use" in refused.stderr
    for b in branches:
        assert cli(daemon, "sandbox", "rm", b["id"]).returncode == 0
    assert cli(daemon, "sandbox", "rm", sb_id).returncode == 0
    assert cli(daemon, "snapshot", "rm", snap["id"]).returncode == 0


def test_creates_and_forks_with_one_idempotency_key_are_made_once(daemon: Daemon) -> None:
    """Two creates sent at once with one key (a client's retry racing its first try): one
    sandbox, the same id answered twice; another key makes a second one (the control).
    Also through E2B's create, and for a fork."""
    label = {"suite": "idempotent"}
    with daemon.client() as one, daemon.client() as two, ThreadPoolExecutor(2) as pool:
        both = [pool.submit(c.create, labels=label, idempotency_key="create-1") for c in (one, two)]
        first, second = (f.result(timeout=600) for f in both)
        try:
            assert first.id == second.id
            assert [s.id for s in one.list(labels=label)] == [first.id]
            again = one.create(labels=label, idempotency_key="create-1")  # a later retry
            assert again.id == first.id
            with pytest.raises(errors.Conflict, match="another request body"):
                one.create(labels={"suite": "other"}, idempotency_key="create-1")
            other = one.create(labels=label, idempotency_key="create-2")  # the control
            assert other.id != first.id
            assert sorted(s.id for s in one.list(labels=label)) == sorted([first.id, other.id])
            other.delete()

            forks = [pool.submit(first.fork, idempotency_key="fork-1") for _ in range(2)]
            made = [[s.id for s in f.result(timeout=600)] for f in forks]
            assert made[0] == made[1] and len(made[0]) == 1
            one.get(made[0][0]).delete()

            head = {"X-API-KEY": daemon.admin_key, "Idempotency-Key": "e2b-1"}
            e2b = [
                httpx2.post(f"{daemon.url}/sandboxes", json={}, headers=head, timeout=600)
                for _ in range(2)
            ]
            assert [r.status_code for r in e2b] == [201, 201], e2b[0].text
            ids = {r.json()["sandboxID"] for r in e2b}
            assert len(ids) == 1
            one.get(ids.pop()).delete()
        finally:
            first.delete()
