"""Forks of a busy sandbox are exact copies: 50 branches, taken in rounds while the parent's
processes run and write memory, each checked for memory copied at one instant (a checksum
of memory that changes while the snapshots are taken) and for its processes going on. A
snapshot that copied RAM while the guest ran (or a restore that mapped it wrong, or a layer
written in the wrong place) shows here as a wrong checksum, a dead process or a guest that
does not answer. Rounds alternate between `fork(n)` (flattened
first) and forks of a fresh snapshot while its layer is being flattened in the background
(restores from the layer and the flatten racing)."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from cella import Client, Sandbox

pytestmark = [pytest.mark.vm, pytest.mark.slow]

ROUNDS, PER_ROUND = 10, 5

# 4 MiB of memory that changes all the time, with its sum kept beside it: each step changes
# one 8-byte word (on another page than the step before) and the sum with it, so whenever
# the process is between steps the two agree. A copy of its memory that was not taken at
# one instant (pages copied while the guest ran) holds words and a sum from different
# moments: the copy's keeper finds them disagreeing when asked (/tmp/ask). While /tmp/churn
# exists it changes the memory at about half a core (the busy parent); a branch stops that
# first, so its branches do not starve two cores.
KEEPER = r"""
import json, os, random, time
words = memoryview(bytearray(random.Random(20261201).randbytes(4 << 20))).cast("Q")
total = sum(words)
steps = asks = 0
while True:
    if os.path.exists("/tmp/ask"):
        os.unlink("/tmp/ask")
        asks += 1
        with open("/tmp/state.tmp", "w") as f:
            json.dump({"n": asks, "agrees": sum(words) == total, "steps": steps}, f)
        os.replace("/tmp/state.tmp", "/tmp/state")
    if not os.path.exists("/tmp/churn"):
        time.sleep(0.05)
        continue
    began = time.monotonic()
    for _ in range(1024):
        at = steps * 40503 % len(words)  # an odd stride: every word, pages far apart
        new = (steps * 0x9E3779B97F4A7C15 + total) & 0xFFFFFFFFFFFFFFFF
        total += new - words[at]
        words[at] = new
        steps += 1
    time.sleep(time.monotonic() - began)  # as long as it ran: half a core
"""


@pytest.fixture(scope="module")
def daemon_settings() -> dict[str, str]:
    return {"pool_size": "0", "max_sandboxes_per_tenant": "20"}


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


def verify(branch: Sandbox) -> int:
    now = asked(branch, calm=True)
    assert now["agrees"] is True, (branch.id, now)  # memory and sum from one instant
    alive = branch.exec(["pgrep", "-fx", "python3 /tmp/keeper.py"]).stdout.split()
    assert len(alive) == 1, (branch.id, alive)  # the one keeper, on in the copy
    return 1


def churning(parent: Sandbox) -> int:
    """The parent's keeper agrees with itself and is changing its memory: its steps."""
    now = asked(parent, calm=False)
    assert now["agrees"] is True, now
    steps = now["steps"]
    assert isinstance(steps, int)
    return steps


def test_fifty_forks_of_a_busy_sandbox_are_exact(admin: Client) -> None:
    with (
        admin.create(memory_mib=512) as parent,
        ThreadPoolExecutor(PER_ROUND) as pool,
    ):
        parent.files.write("/tmp/keeper.py", KEEPER)
        parent.exec("touch /tmp/churn; nohup python3 /tmp/keeper.py >/tmp/keeper.log 2>&1 &")
        steps = churning(parent)  # control: the parent's own memory and sum agree
        checked = 0
        for round_ in range(ROUNDS):
            if round_ % 2 == 0:
                branches = parent.fork(PER_ROUND)  # while the parent churns
            else:
                snap = parent.snapshot(f"round-{round_}")
                branches = snap.fork(PER_ROUND)
            try:
                checked += sum(pool.map(verify, branches))
            finally:
                list(pool.map(lambda b: b.delete(), branches))
            if round_ % 2:
                snap.delete()
            # the parent ran on, changing the memory across the snapshot
            steps, before = churning(parent), steps
            assert steps > before
        assert checked == ROUNDS * PER_ROUND
