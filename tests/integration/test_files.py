"""File operations on a real microVM."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile

import pytest

from cella import errors
from cella.runtime.qemu.vm import QemuVM

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
