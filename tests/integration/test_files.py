"""File operations on a real microVM: the agent's own, and the files room's walk, move and
chown through the daemon's API, the SDK and the CLI."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile

import pytest

from cella import Client, errors
from cella.runtime.qemu.vm import QemuVM
from tests.daemon import Daemon

pytestmark = pytest.mark.vm


async def test_large_file_round_trip(vm: QemuVM) -> None:
    data = os.urandom(50 << 20)
    await vm.agent.write_file("/tmp/big.bin", data)
    r = await vm.agent.exec(["sha256sum", "/tmp/big.bin"])
    assert r.stdout.split()[0].decode() == hashlib.sha256(data).hexdigest()
    chunks = [c async for c in vm.agent.read_stream("/tmp/big.bin")]
    assert len(chunks) > 1  # streamed, not one giant frame
    assert hashlib.sha256(b"".join(chunks)).digest() == hashlib.sha256(data).digest()
    await vm.agent.remove("/tmp/big.bin")


async def test_write_is_atomic_and_sets_mode(vm: QemuVM) -> None:
    await vm.agent.write_file("/tmp/a/b/c.sh", b"#!/bin/sh\necho hi\n", mode=0o750, parents=True)
    st = await vm.agent.stat("/tmp/a/b/c.sh")
    assert (st.kind, st.mode, st.size) == ("file", 0o750, 18)
    assert (await vm.agent.exec(["/tmp/a/b/c.sh"])).stdout == b"hi\n"
    await vm.agent.write_file("/tmp/a/b/c.sh", b"new")
    assert await vm.agent.read_file("/tmp/a/b/c.sh") == b"new"
    names = [e.name for e in await vm.agent.list_dir("/tmp/a/b")]
    assert names == ["c.sh"]  # no temporary files left behind
    await vm.agent.remove("/tmp/a", recursive=True)


async def test_list_stat_mkdir_chmod_remove(vm: QemuVM) -> None:
    await vm.agent.mkdir("/tmp/d/e", parents=True)
    await vm.agent.write_file("/tmp/d/f.txt", b"x")
    await vm.agent.exec("ln -s f.txt /tmp/d/link")
    entries = {e.name: e for e in await vm.agent.list_dir("/tmp/d")}
    assert entries["e"].kind == "dir" and entries["f.txt"].kind == "file"
    assert entries["link"].kind == "symlink" and entries["link"].target == "f.txt"
    await vm.agent.chmod("/tmp/d/f.txt", 0o600)
    assert (await vm.agent.stat("/tmp/d/f.txt")).mode == 0o600
    with pytest.raises(errors.DirectoryNotEmpty):
        await vm.agent.remove("/tmp/d")
    await vm.agent.remove("/tmp/d", recursive=True)
    with pytest.raises(errors.NotFound):
        await vm.agent.stat("/tmp/d")


async def test_errors_have_clear_codes(vm: QemuVM) -> None:
    with pytest.raises(errors.NotFound):
        await vm.agent.read_file("/no/such/file")
    with pytest.raises(errors.NotADirectory):
        await vm.agent.write_file("/etc/hostname/child", b"x")
    with pytest.raises(errors.IsADirectory):
        await vm.agent.read_file("/etc")
    with pytest.raises(errors.IsADirectory):
        await vm.agent.write_file("/etc", b"x")
    with pytest.raises(errors.AlreadyExists):
        await vm.agent.mkdir("/etc")
    with pytest.raises(errors.PermissionDenied):
        await vm.agent.remove("/")
    with pytest.raises(errors.InvalidArgument):
        await vm.agent.read_file("relative/path")
    with pytest.raises(errors.InvalidArgument):
        await vm.agent.read_file("/etc/\x00passwd")
    with pytest.raises(errors.NotFound):
        await vm.agent.list_dir("/no/such/dir")


def _tree() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, content in {
            "top.txt": b"top",
            "sub/inner.txt": b"inner" * 1000,
            "sub/deeper/x.bin": os.urandom(300_000),
        }.items():
            info = tarfile.TarInfo(name)
            info.size = len(content)
            info.mode = 0o640
            tar.addfile(info, io.BytesIO(content))
    return buf.getvalue()


def _members(archive: bytes) -> dict[str, bytes]:
    out = {}
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for m in tar.getmembers():
            if m.isfile():
                f = tar.extractfile(m)
                assert f is not None
                out[m.name.removeprefix("./")] = f.read()
    return out


async def test_directory_round_trips_as_tar(vm: QemuVM) -> None:
    archive = _tree()
    await vm.agent.tar_in("/tmp/tree", archive)
    assert await vm.agent.read_file("/tmp/tree/top.txt") == b"top"
    back = b"".join([c async for c in vm.agent.tar_out("/tmp/tree")])
    assert _members(back) == _members(archive)
    await vm.agent.remove("/tmp/tree", recursive=True)


async def test_bad_archive_is_refused_and_leaves_agent_working(vm: QemuVM) -> None:
    with pytest.raises(errors.InvalidArgument):
        await vm.agent.tar_in("/tmp/bad", b"this is not a tar archive" * 100)
    with pytest.raises(errors.NotADirectory):
        [c async for c in vm.agent.tar_out("/etc/hostname")]
    assert (await vm.agent.exec(["true"])).exit_code == 0


def test_walk_move_and_chown_through_the_api(admin: Client) -> None:
    """The files room's walk, move and chown on a real guest, through /v1 and the SDK: the
    walk's order and bounds, links not followed, names that look like options or carry
    spaces moved as names, owners given (recursively) and refused."""
    with admin.create() as sb:
        sb.exec("mkdir -p /tmp/t/a/b/c && echo hi > '/tmp/t/a/x y' && touch /tmp/t/a/b/c/z"
                " && ln -s /etc /tmp/t/link", check=True)  # fmt: skip
        tree = sb.files.walk("/tmp/t")
        assert [(e.path, e.kind) for e in tree.entries] == [
            ("/tmp/t/a", "dir"),
            ("/tmp/t/link", "symlink"),  # listed, not followed
            ("/tmp/t/a/b", "dir"),
            ("/tmp/t/a/x y", "file"),
            ("/tmp/t/a/b/c", "dir"),
            ("/tmp/t/a/b/c/z", "file"),
        ]
        assert not tree.truncated
        shallow = sb.files.walk("/tmp/t", depth=1)
        assert [e.name for e in shallow.entries] == ["a", "link"] and not shallow.truncated
        cut = sb.files.walk("/tmp/t", limit=3)
        assert len(cut.entries) == 3 and cut.truncated
        with pytest.raises(errors.NotFound):
            sb.files.walk("/tmp/none")

        moved = sb.files.move("/tmp/t/a/x y", "/tmp/t/--help")
        assert (moved.name, moved.kind, moved.size) == ("--help", "file", 3)
        assert sb.files.read("/tmp/t/--help") == b"hi\n"
        assert not sb.files.exists("/tmp/t/a/x y")
        sb.files.move("/tmp/t/a/b", "/tmp/t/-R")  # a directory, named like an option
        assert sb.files.stat("/tmp/t/-R/c/z").kind == "file"
        with pytest.raises(errors.NotFound):
            sb.files.move("/tmp/t/nothing", "/tmp/t/elsewhere")

        owners = "stat -c %U:%G /tmp/t/-R /tmp/t/-R/c/z /tmp/t/--help"
        assert sb.exec(owners).stdout.split() == [b"root:root"] * 3  # control
        sb.files.chown("/tmp/t/-R", "user", recursive=True)
        sb.files.chown("/tmp/t/--help", "user", "root")
        assert sb.exec(owners).stdout.split() == [b"user:user", b"user:user", b"user:root"]
        with pytest.raises(errors.InvalidArgument):  # not a name: refused before the guest
            sb.files.chown("/tmp/t/--help", "--reference=/etc/shadow")
        with pytest.raises(errors.UnknownUser):
            sb.files.chown("/tmp/t/--help", "nosuchuser")
        assert sb.exec(owners).stdout.split()[2] == b"user:root"  # unchanged by the refusals
        commands = [str(e.data.get("command")) for e in sb.events(types=["exec"])]
        assert not any("--reference" in c for c in commands)

        kinds = [e.type for e in sb.events()]
        assert kinds.count("file_move") == 2 and kinds.count("chown") == 2


def test_walk_move_and_chown_through_the_cli(daemon: Daemon, admin: Client) -> None:
    def cella(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "cella.cli", "files", *args],
            env=daemon.env(),
            capture_output=True,
            text=True,
            timeout=300,
        )

    with admin.create() as sb:
        sb.files.write("/tmp/c/d/f.txt", "cli", parents=True)
        walked = cella("walk", sb.id, "/tmp/c", "--json")
        assert walked.returncode == 0, walked.stderr
        tree = json.loads(walked.stdout)
        assert [e["path"] for e in tree["entries"]] == ["/tmp/c/d", "/tmp/c/d/f.txt"]
        assert tree["truncated"] is False
        cut = cella("walk", sb.id, "/tmp/c", "--limit", "1")
        assert cut.returncode == 0 and "/tmp/c/d" in cut.stdout and "truncated" in cut.stderr
        moved = cella("mv", sb.id, "/tmp/c/d/f.txt", "/tmp/c/g.txt")
        assert moved.returncode == 0, moved.stderr
        assert sb.files.read("/tmp/c/g.txt") == b"cli"
        owned = cella("chown", sb.id, "/tmp/c", "user:root", "-R")
        assert owned.returncode == 0, owned.stderr
        assert sb.exec("stat -c %U:%G /tmp/c/g.txt").stdout == b"user:root\n"
        refused = cella("chown", sb.id, "/tmp/c", "no body")
        assert refused.returncode == 1 and "invalid_argument" in refused.stderr
