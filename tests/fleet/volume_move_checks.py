"""Sandboxes that mount volumes moving between the fleet's nodes (collected by
`tests/integration/test_fleet.py` only, inside a loopback-only network namespace): a
running one moves to a node that is not its volume's home (the volume lent there first)
with its processes and its mount going on, what it writes reaching the volume's home; a
drain of the volume's home leaves the sandbox mounting it there, saying why, and moves
the rest (the control: one without volumes)."""

from __future__ import annotations

import json
import time

import httpx2

from cella.fleet.relay import NODE_HINT
from tests.fleet.conftest import NODES, SHAPE, Fleet
from tests.fleet.move_checks import COUNTER, cli
from tests.fleet.replica_checks import counter, started
from tests.fleet.shared_checks import home_of, made, read_until, shell, wait_for


def test_a_sandbox_mounting_a_volume_moves_and_a_drain_of_its_home_leaves_it(
    fleet: Fleet, tenant: httpx2.Client
) -> None:
    vol = made(tenant.post("/v1/volumes", json={"name": "moving-vol"}))
    home = home_of(fleet, vol["id"])
    first, second = (n for n in NODES if n != home)
    mounts = [{"volume": "moving-vol", "path": "/mnt/v"}]
    ids: list[str] = []
    try:
        stays = made(tenant.post("/v1/sandboxes", json={**SHAPE, "volume_mounts": mounts}))
        control = made(tenant.post("/v1/sandboxes", json=SHAPE, headers={NODE_HINT: home}))
        mover = made(tenant.post(
            "/v1/sandboxes", json={**SHAPE, "volume_mounts": mounts}, headers={NODE_HINT: first}
        ))  # fmt: skip
        ids += [str(stays["id"]), str(control["id"]), str(mover["id"])]
        assert fleet.node_of(stays["id"]) == fleet.node_of(control["id"]) == home
        assert fleet.node_of(mover["id"]) == first  # the volume lent to it
        shell(tenant, mover["id"], COUNTER)
        shell(tenant, mover["id"], "echo before > /mnt/v/before.txt")
        time.sleep(1)
        before, began = counter(tenant, mover["id"]), started(tenant, mover["id"])

        # a move to a node that is not the volume's home: lent there, the mount goes on
        moved = tenant.post(f"/v1/sandboxes/{mover['id']}/move", json={"node": second})
        assert moved.status_code == 200, moved.text
        assert moved.json()["ok"] and moved.json()["to"] == second, moved.text
        assert fleet.node_of(mover["id"]) == second
        assert started(tenant, mover["id"]) == began and counter(tenant, mover["id"]) >= before
        assert shell(tenant, mover["id"], "cat /mnt/v/before.txt") == "before\n"
        shell(tenant, mover["id"], "echo after > /mnt/v/after.txt")
        got = wait_for(
            lambda: (r := tenant.get("/v1/volumes/moving-vol/content",
                                     params={"path": "/after.txt"})).status_code == 200 and r,
            timeout=30, what="the write after the move on the volume's home",
        )  # fmt: skip
        assert got.content == b"after\n"
        assert (fleet.node_root / home / "volumes" / vol["id"] / "after.txt").exists()
        wrote = tenant.put(
            "/v1/volumes/moving-vol/content", params={"path": "/from-api.txt"}, content=b"api\n"
        )
        assert wrote.status_code == 200, wrote.text
        assert read_until(tenant, mover["id"], "/mnt/v/from-api.txt") == "api\n"

        # a drain of the volume's home: the sandbox mounting it stays, named with why; the
        # control moves; the CLI says what it left behind
        drained = cli(fleet, "drain", home, "--json")
        assert drained.returncode == 1, drained.stderr
        report = {m["id"]: m for m in json.loads(drained.stdout)["moves"]}
        assert report[control["id"]]["ok"] and report[control["id"]]["to"] != home
        left = report[stays["id"]]
        assert not left["ok"] and "moving-vol" in left["error"], left
        assert f"lives on node {home}" in left["error"], left
        assert fleet.node_of(stays["id"]) == home and fleet.node_of(control["id"]) != home
        assert shell(tenant, stays["id"], "cat /mnt/v/after.txt") == "after\n"  # untouched
        again = cli(fleet, "drain", home)  # as a person reads it
        assert again.returncode == 1 and f"left on {home}" in again.stderr, again.stderr
        assert stays["id"] in again.stderr and "moving-vol" in again.stderr, again.stderr
    finally:
        uncordoned = cli(fleet, "uncordon", home)
        for sandbox_id in ids:
            tenant.delete(f"/v1/sandboxes/{sandbox_id}")
    assert uncordoned.returncode == 0, uncordoned.stderr
    assert tenant.delete("/v1/volumes/moving-vol").status_code == 204
