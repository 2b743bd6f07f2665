"""A create the fleet has no room for: refused at once unless the fleet autoscales (the
waiting itself is shown on a real autoscaling cluster, tests/fleet/autoscale_checks.py)."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from cella import errors
from cella.fleet.growth import Growth


def growth(enabled: bool) -> Growth:
    return Growth(cast(Any, None), cast(Any, None), enabled, wait_s=60, grace_s=0)


async def full() -> dict[str, int]:
    raise errors.CapacityExceeded("the fleet has no room for 1 sandbox(es)")


async def room() -> dict[str, int]:
    return {"n1": 1}


def test_without_autoscaling_no_room_is_refused_at_once() -> None:
    with pytest.raises(errors.CapacityExceeded, match="no room"):
        asyncio.run(asyncio.wait_for(growth(False).plan(full, None), 5))


def test_sandboxes_bound_to_one_node_do_not_wait_for_another() -> None:
    with pytest.raises(errors.CapacityExceeded, match="no room"):
        asyncio.run(asyncio.wait_for(growth(True).plan(full, "n1"), 5))


def test_with_room_the_plan_is_made_at_once_either_way() -> None:
    for enabled in (False, True):
        assert asyncio.run(growth(enabled).plan(room, None)) == {"n1": 1}
