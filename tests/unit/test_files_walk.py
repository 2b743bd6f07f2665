"""The files room's walk over a tree of directories in memory: breadth first, each
directory's entries in name order, held to its bounds on depth, entries and time."""

from __future__ import annotations

import asyncio

import pytest

from cella import errors
from cella.guest.protocol import Entry
from cella.models import MAX_WALK_DEPTH, MAX_WALK_ENTRIES
from cella.service.files import Walk

TREE = {
    "/r": ["a", "b/", "c/"],
    "/r/b": ["x", "y/"],
    "/r/b/y": ["z"],
    "/r/c": ["w"],
}


def lister(tree: dict[str, list[str]], listed: list[str] | None = None):  # type: ignore[no-untyped-def]
    async def list_dir(path: str) -> list[Entry]:
        if listed is not None:
            listed.append(path)
        if path not in tree:
            raise errors.NotFound(f"{path}: no such directory")
        return [
            Entry(name.rstrip("/"), "dir" if name.endswith("/") else "file", 0o755, 0, 0, 0, 0)
            for name in tree[path]
        ]

    return list_dir


async def walked(walk: Walk) -> list[str]:
    return [found.relative async for found in walk]


async def test_breadth_first_to_the_depth_asked_for() -> None:
    everything = Walk(lister(TREE), "/r", depth=None)
    assert await walked(everything) == ["a", "b", "c", "b/x", "b/y", "c/w", "b/y/z"]
    assert not everything.truncated
    one = Walk(lister(TREE), "/r", depth=1)
    assert await walked(one) == ["a", "b", "c"]
    assert not one.truncated  # the levels below a depth asked for are not a truncation
    found = [(f.path, f.relative, f.entry.kind) async for f in Walk(lister(TREE), "/r", depth=2)]
    assert found[3] == ("/r/b/x", "b/x", "file") and len(found) == 6


async def test_the_entry_bound_truncates() -> None:
    walk = Walk(lister(TREE), "/r", depth=None, limit=4)
    assert await walked(walk) == ["a", "b", "c", "b/x"] and walk.truncated
    exact = Walk(lister(TREE), "/r", depth=None, limit=7)  # control: exactly the tree
    assert len(await walked(exact)) == 7 and not exact.truncated


async def test_no_deeper_than_the_depth_bound() -> None:
    chain = {"/" + "/".join(["d"] * n) if n else "/": ["d/"] for n in range(MAX_WALK_DEPTH + 5)}
    listed: list[str] = []
    walk = Walk(lister(chain, listed), "/", depth=None)
    assert len(await walked(walk)) == MAX_WALK_DEPTH and walk.truncated
    assert len(listed) == MAX_WALK_DEPTH  # the directories below were never listed
    shallow = {k: v for k, v in chain.items() if k.count("/") < 10}  # control: ends first
    ended = Walk(lister(shallow), "/", depth=None)
    assert len(await walked(ended)) == 10 and not ended.truncated


@pytest.mark.parametrize("bounds", [{"depth": 0}, {"depth": MAX_WALK_DEPTH + 1},
                                    {"depth": 10**9}, {"limit": 0},
                                    {"limit": MAX_WALK_ENTRIES + 1}])  # fmt: skip
def test_bounds_beyond_the_rooms_are_refused(bounds: dict[str, int]) -> None:
    with pytest.raises(errors.InvalidArgument):
        Walk(lister(TREE), "/r", **bounds)


async def test_the_time_bound_truncates() -> None:
    async def slow(path: str) -> list[Entry]:
        await asyncio.sleep(0.05)
        return [Entry(f"d{len(path)}", "dir", 0o755, 0, 0, 0, 0)]

    walk = Walk(slow, "/", depth=None, seconds=0.2)
    assert 2 <= len(await walked(walk)) < 10 and walk.truncated


async def test_a_directory_gone_while_walked_is_passed_over_the_root_is_not() -> None:
    gone = {**TREE, "/r": ["a", "b/", "gone/", "c/"]}
    assert "gone" in await walked(Walk(lister(gone), "/r", depth=None))
    assert "b/y/z" in await walked(Walk(lister(gone), "/r", depth=None))
    with pytest.raises(errors.NotFound):
        await walked(Walk(lister(TREE), "/nowhere", depth=None))


async def test_paths_from_the_file_system_root() -> None:
    walk = Walk(lister({"/": ["etc/"], "/etc": ["hosts"]}), "/", depth=2)
    found = [(f.path, f.relative) async for f in walk]
    assert found == [("/etc", "etc"), ("/etc/hosts", "etc/hosts")]
