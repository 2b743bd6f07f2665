"""The files room's walk, move and chown through their /v1 doors and the SDK, in process on
the fake runtime: what reaches the guest (argv, never a shell; every operand after `--`),
what is refused before it, the trace. (tests/integration/test_files.py runs them on a real
guest.)"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest

from cella import errors
from cella.models import MAX_WALK_DEPTH
from tests.unit.in_process import InProcess, serving


@pytest.fixture
async def app(tmp_path: Path) -> AsyncIterator[InProcess]:
    async with serving(tmp_path) as served:
        yield served


async def test_move_and_chown_run_argv_with_operands_after_dashes(app: InProcess) -> None:
    async with app.client() as client, await client.create() as sb:
        agent = app.vm(sb.id).agent
        ran: list[Sequence[str] | str] = []

        async def guest(argv: Sequence[str] | str) -> tuple[int, bytes, bytes]:
            ran.append(argv)
            if argv[0] == "mv":
                agent.files[argv[-1]] = agent.files.pop(argv[-2])
            return 0, b"", b""

        agent.handler = guest
        await sb.files.write("/w/a b;c", b"data")
        moved = await sb.files.move("/w/a b;c", "/w/-rf")
        assert (moved.name, moved.size) == ("-rf", 4)
        assert await sb.files.read("/w/-rf") == b"data"
        await sb.files.chown("/w/-rf", "user", recursive=True)
        await sb.files.chown("/w/-rf", "1000", "staff")
        assert ran == [
            ["mv", "-T", "--", "/w/a b;c", "/w/-rf"],
            ["chown", "-R", "--", "user:", "/w/-rf"],
            ["chown", "--", "1000:staff", "/w/-rf"],
        ]
        events = await sb.events(types=["file_move", "chown"])
        assert [e.data for e in events] == [
            {"source": "/w/a b;c", "destination": "/w/-rf"},
            {"path": "/w/-rf", "user": "user", "group": None, "recursive": True},
            {"path": "/w/-rf", "user": "1000", "group": "staff", "recursive": False},
        ]


@pytest.mark.parametrize("user", ["--reference=/etc/shadow", "-R", "a b", "u:g", "x" * 40, ""])
async def test_names_that_are_not_names_never_reach_the_guest(app: InProcess, user: str) -> None:
    async with app.client() as client, await client.create() as sb:
        agent = app.vm(sb.id).agent
        await sb.files.write("/w/f", b"x")
        with pytest.raises(errors.InvalidArgument):
            await sb.files.chown("/w/f", user)
        with pytest.raises(errors.InvalidArgument):
            await sb.files.chown("/w/f", "user", user or "-")
        assert agent.execs == []
        await sb.files.chown("/w/f", "user")  # control: a name goes through
        assert agent.execs == [["chown", "--", "user:", "/w/f"]]


async def test_a_missing_path_is_not_found_before_the_guest_runs_anything(
    app: InProcess,
) -> None:
    async with app.client() as client, await client.create() as sb:
        with pytest.raises(errors.NotFound):
            await sb.files.move("/w/none", "/w/other")
        with pytest.raises(errors.NotFound):
            await sb.files.chown("/w/none", "user")
        assert app.vm(sb.id).agent.execs == []


async def test_a_walk_through_the_api_says_when_a_bound_ended_it(app: InProcess) -> None:
    async with app.client() as client, await client.create() as sb:
        for name in ("a", "b", "c"):
            await sb.files.write(f"/w/{name}", name.encode())
        tree = await sb.files.walk("/w")
        assert [(e.path, e.name, e.size) for e in tree.entries] == [
            ("/w/a", "a", 1),
            ("/w/b", "b", 1),
            ("/w/c", "c", 1),
        ]
        assert not tree.truncated
        cut = await sb.files.walk("/w", limit=2)
        assert [e.path for e in cut.entries] == ["/w/a", "/w/b"] and cut.truncated
        with pytest.raises(errors.InvalidArgument):
            await sb.files.walk("/w", depth=MAX_WALK_DEPTH + 1)
        with pytest.raises(errors.InvalidArgument):
            await sb.files.walk("w")  # not absolute
