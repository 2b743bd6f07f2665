"""The gateway's record of the node each volume and named template lives on (SQLite), and
where a sandbox that mounts volumes is best placed."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from cella import errors
from cella.fleet.homes import Home, Homes
from cella.fleet.volumes import FleetVolumes
from cella.service.keys import Principal


def test_homes_are_found_by_id_or_name_within_their_tenant(tmp_path: Path) -> None:
    homes = Homes(tmp_path / "h.db")
    homes.put(Home("volume", "acme", "vol-1", "data", "n1"))
    homes.put(Home("volume", "globex", "vol-2", "data", "n2"))
    homes.put(Home("template", "acme", "tpl-1", "data", "n3"))
    assert homes.find("volume", "acme", "data") == Home("volume", "acme", "vol-1", "data", "n1")
    assert homes.find("volume", "acme", "vol-1") is not None
    assert homes.find("volume", "acme", "vol-2") is None  # another tenant's
    assert homes.find("template", "acme", "data").node == "n3"  # type: ignore[union-attr]
    assert homes.by_id("volume", "vol-2").tenant == "globex"  # type: ignore[union-attr]
    assert homes.count_on("volume", "n1") == 1 and homes.count_on("volume", "n3") == 0
    again = Homes(tmp_path / "h.db")  # kept across a gateway restart
    again.forget("volume", "vol-1")
    assert again.find("volume", "acme", "data") is None
    assert [h.id for h in again.of_tenant("volume", "globex")] == ["vol-2"]


class NoNodes:
    """A fleet whose nodes know no volume the table does not (nothing to ask)."""

    def healthy(self) -> list[Any]:
        return []


def test_a_sandbox_is_best_placed_on_its_first_volumes_home(tmp_path: Path) -> None:
    homes = Homes(tmp_path / "h.db")
    homes.put(Home("volume", "acme", "vol-a", "a", "n1"))
    homes.put(Home("volume", "acme", "vol-c", "c", "n2"))
    volumes = FleetVolumes(NoNodes(), homes)  # type: ignore[arg-type]
    who = Principal("acme", False)

    def home_of(mounts: Any) -> str | None:
        return asyncio.run(volumes.home_of(who, mounts))

    assert home_of(None) is None and home_of([]) is None
    assert home_of([{"volume": "c", "path": "/c"}, {"volume": "vol-a", "path": "/a"}]) == "n2"
    with pytest.raises(errors.InvalidArgument, match="no volume 'nope'"):
        home_of([{"volume": "a", "path": "/a"}, {"volume": "nope", "path": "/x"}])
    other = Principal("globex", False)  # another tenant's names mean nothing here
    with pytest.raises(errors.InvalidArgument, match="no volume 'a'"):
        asyncio.run(volumes.home_of(other, [{"volume": "a", "path": "/a"}]))
