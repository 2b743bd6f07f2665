"""The SDK against the daemon's real app in this process (`httpx2.ASGITransport`), its
service on the fake runtime: what the SDK sends, the routes' answers and the typed errors
it raises, without a VM or a socket. (The same calls run on real microVMs over HTTP in
tests/integration/test_api_lifecycle.py.)"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path

import pytest
from anyio.from_thread import BlockingPortal, start_blocking_portal

from cella import errors
from tests.unit.in_process import InProcess, serving


@pytest.fixture
async def app(tmp_path: Path) -> AsyncIterator[InProcess]:
    async with serving(tmp_path, max_sandboxes_per_tenant=2) as served:
        yield served


async def test_create_list_get_and_delete(app: InProcess) -> None:
    async with app.client() as client:
        sb = await client.create(labels={"team": "a"}, memory_mib=512)
        assert (sb.state, sb.info.memory_mib, sb.info.labels) == ("running", 512, {"team": "a"})
        other = await client.create()
        assert [s.id for s in await client.list(labels={"team": "a"})] == [sb.id]
        assert {s.id for s in await client.list()} == {sb.id, other.id}
        got = await client.get(sb.id)
        assert (got.id, got.state) == (sb.id, "running")
        await (await sb.stop()).resume()
        assert (await sb.refresh()).state == "running"
        await sb.delete()
        await other.delete()
        assert await client.list() == []


async def test_exec_and_its_stream(app: InProcess) -> None:
    async def answer(argv: Sequence[str] | str) -> tuple[int, bytes, bytes]:
        return (3, b"out", b"err") if "fail" in argv else (0, b"ran " + str(argv).encode(), b"")

    async with app.client() as client, await client.create() as sb:
        app.vm(sb.id).agent.handler = answer
        ok = await sb.exec(["echo", "hi"])
        assert (ok.exit_code, ok.stdout) == (0, b"ran ['echo', 'hi']")
        failed = await sb.exec(["fail"])
        assert (failed.exit_code, failed.stdout, failed.stderr) == (3, b"out", b"err")
        with pytest.raises(errors.CommandFailed):
            await sb.exec(["fail"], check=True)
        events = [e async for e in sb.exec_stream(["fail"])]
        assert [e.type for e in events] == ["started", "stdout", "stderr", "exit"]
        assert events[-1].exit_code == 3


async def test_files(app: InProcess) -> None:
    async with app.client() as client, await client.create() as sb:
        entry = await sb.files.write("/work/notes.txt", "hello")
        assert (entry.name, entry.size) == ("notes.txt", 5)
        assert await sb.files.read_text("/work/notes.txt") == "hello"
        assert b"".join([c async for c in sb.files.read_stream("/work/notes.txt")]) == b"hello"
        assert [e.name for e in await sb.files.list("/work")] == ["notes.txt"]
        assert await sb.files.exists("/work/notes.txt")
        await sb.files.remove("/work/notes.txt")
        assert not await sb.files.exists("/work/notes.txt")
        with pytest.raises(errors.NotFound):
            await sb.files.read("/work/notes.txt")


async def test_errors_are_typed(app: InProcess) -> None:
    async with app.client() as admin:
        created = await admin.create_key("acme")
        mine = await admin.create()
        with pytest.raises(errors.NotFound):
            await admin.get("sb-none")
        with pytest.raises(errors.InvalidArgument):
            await admin.create(memory_mib=1)
        async with app.client(created["key"]) as tenant:
            with pytest.raises(errors.NotFound):  # another tenant's sandbox is not there
                await tenant.get(mine.id)
            await tenant.create()
            await tenant.create()
            with pytest.raises(errors.QuotaExceeded):
                await tenant.create()
            read_only = (await admin.create_key("acme", read_only=True))["key"]
            async with app.client(read_only) as looker:
                assert len(await looker.list()) == 2  # control: the key reads
                with pytest.raises(errors.PermissionDenied):
                    await looker.create()
            await admin.revoke_key(created["id"])
            with pytest.raises(errors.Unauthenticated):
                await tenant.list()
    async with app.client("not-a-key") as stranger:
        with pytest.raises(errors.Unauthenticated):
            await stranger.list()


@pytest.fixture
def portal() -> Iterator[BlockingPortal]:
    with start_blocking_portal() as running:
        yield running


def test_the_sync_client(portal: BlockingPortal, tmp_path: Path) -> None:
    with portal.wrap_async_context_manager(serving(tmp_path)) as app:
        with app.sync_client(portal) as client, client.create(labels={"k": "v"}) as sb:
            assert [s.id for s in client.list()] == [sb.id]
            assert client.get(sb.id).state == "running"
            assert sb.exec(["echo", "hi"]).stdout == b"echo hi"
            sb.files.write("/a", b"\x00\xff")
            assert sb.files.read("/a") == b"\x00\xff"
            with pytest.raises(errors.NotFound):
                client.get("sb-none")
        with app.sync_client(portal) as client:
            assert client.list() == []  # leaving the block deleted the sandbox
