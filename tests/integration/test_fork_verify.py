"""Forks of a busy sandbox are exact copies: 50 branches, taken in rounds while the parent's
processes run and write memory, each checked for a memory checksum and for its processes
going on. A snapshot that copied RAM while the guest ran (or a restore that mapped it
wrong, or a layer written in the wrong place) shows here as a wrong checksum, a dead
process or a guest that does not answer. Rounds alternate between `fork(n)` (flattened
first) and forks of a fresh snapshot while its layer is being flattened in the background
(restores from the layer and the flatten racing)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from cella import Client, Sandbox
from tests.daemon import Daemon, running_daemon

pytestmark = pytest.mark.vm

ROUNDS, PER_ROUND = 10, 5

# 4 MiB of pseudo-random pages, fixed once and checksummed again on request (/tmp/ask);
# while /tmp/churn exists, a thread keeps dirtying 4 MiB of its own (the busy parent, at
# about half a core), and a branch stops it first, so its branches do not starve two cores
KEEPER = r"""
import hashlib, json, os, random, threading, time
kept = bytearray(random.Random(20261201).randbytes(4 << 20))
open("/tmp/expected", "w").write(hashlib.sha256(kept).hexdigest())
scratch = bytearray(4 << 20)
def churn():
    i = 0
    while True:
        if i % 4096 == 0 and not os.path.exists("/tmp/churn"):
            time.sleep(0.2)
        scratch[(i * 4099) % len(scratch)] = i & 0xFF
        i += 1
        if i % 1024 == 0:
            time.sleep(0.002)
threading.Thread(target=churn, daemon=True).start()
n = 0
while True:
    if os.path.exists("/tmp/ask"):
        os.unlink("/tmp/ask")
        n += 1
        with open("/tmp/state.tmp", "w") as f:
            json.dump({"n": n, "sha": hashlib.sha256(kept).hexdigest()}, f)
        os.replace("/tmp/state.tmp", "/tmp/state")
    time.sleep(0.05)
"""


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with running_daemon(
        tmp_path_factory.mktemp("forks"), pool_size="0", max_sandboxes_per_tenant="20"
    ) as d:
        yield d


def state(sb: Sandbox) -> dict[str, object]:
    found: dict[str, object] = json.loads(
        sb.exec("cat /tmp/state 2>/dev/null || echo '{\"n\": 0}'").stdout
    )
    return found


def asked(sb: Sandbox, calm: bool, timeout: float = 60) -> dict[str, object]:
    """The keeper's checksum, computed now: its process lives and runs in `sb`."""
    seen = state(sb)["n"]
    assert sb.exec(("rm -f /tmp/churn; " if calm else "") + "touch /tmp/ask").exit_code == 0
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = state(sb)
        if now["n"] != seen:
            return now
        time.sleep(0.1)
    raise AssertionError(f"the keeper does not answer in {sb.id}")


def verify(branch: Sandbox, expected: str) -> int:
    now = asked(branch, calm=True)
    assert now["sha"] == expected, (branch.id, now)
    alive = branch.exec(["pgrep", "-fx", "python3 /tmp/keeper.py"]).stdout.split()
    assert len(alive) == 1, (branch.id, alive)  # the one keeper, on in the copy
    return 1


def test_fifty_forks_of_a_busy_sandbox_are_exact(daemon: Daemon) -> None:
    with (
        Client(daemon.url, daemon.admin_key) as client,
        client.create(memory_mib=512) as parent,
        ThreadPoolExecutor(PER_ROUND) as pool,
    ):
        parent.files.write("/tmp/keeper.py", KEEPER)
        parent.exec("touch /tmp/churn; nohup python3 /tmp/keeper.py >/tmp/keeper.log 2>&1 &")
        deadline = time.monotonic() + 120
        while parent.exec("test -s /tmp/expected").exit_code != 0:
            assert time.monotonic() < deadline, parent.exec("cat /tmp/keeper.log").stdout
            time.sleep(0.2)
        expected = parent.exec("cat /tmp/expected").stdout.decode()
        assert asked(parent, calm=False)["sha"] == expected  # control: the parent's own
        checked = 0
        for round_ in range(ROUNDS):
            if round_ % 2 == 0:
                branches = parent.fork(PER_ROUND)  # while the parent churns
            else:
                snap = parent.snapshot(f"round-{round_}")
                branches = snap.fork(PER_ROUND)
            try:
                checked += sum(pool.map(lambda b: verify(b, expected), branches))
            finally:
                list(pool.map(lambda b: b.delete(), branches))
            if round_ % 2:
                snap.delete()
            assert asked(parent, calm=False)["sha"] == expected  # the parent ran on
        assert checked == ROUNDS * PER_ROUND
