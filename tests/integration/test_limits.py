"""Limits on real microVMs: runaways stay inside their sandbox; TTL and idle are enforced."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from cella import Client, errors
from tests.daemon import Daemon
from tests.integration.conftest import kill_vms_of

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("limited"), pool_size="0", reaper_interval="0.2").start()
    yield d
    d.stop()
    kill_vms_of(d.data_dir)


@pytest.fixture(scope="module")
def client(limited: Daemon) -> Iterator[Client]:
    with Client(limited.url, limited.admin_key) as c:
        yield c


def test_fork_bomb_is_refused_inside_and_the_sandbox_still_answers(client: Client) -> None:
    with client.create(max_pids=64) as sb, client.create() as neighbour:
        # the timeout's cgroup kill ends the whole bomb, however many forks it managed
        bomb = sb.exec("bomb() { bomb | bomb & }; bomb; sleep 30", timeout=5)
        assert bomb.timed_out
        assert sb.exec("cat /sys/fs/cgroup/cella/pids.max").text.strip() == "64"
        refused = sb.exec("cat /sys/fs/cgroup/cella/pids.events").text.split()
        assert int(refused[1]) > 0  # forks were refused at the limit
        assert sb.exec("echo alive").stdout == b"alive\n"
        assert neighbour.exec("echo fine").stdout == b"fine\n"


def test_memory_hog_is_killed_inside_and_the_agent_survives(client: Client) -> None:
    with client.create(memory_mib=512) as sb, client.create() as neighbour:
        hog = sb.exec(
            ["python3", "-c", "b = []\nwhile True: b.append(bytearray(16 << 20))"], timeout=120
        )
        assert hog.exit_code == 137 and hog.signal == 9  # OOM-killed in its own cgroup
        oom = sb.exec("grep oom_kill /sys/fs/cgroup/cella/memory.events").text
        assert int(oom.split()[-1]) >= 1
        assert sb.exec("echo alive").stdout == b"alive\n"
        assert neighbour.exec("echo fine").stdout == b"fine\n"


def test_infinite_loop_ends_at_its_exec_timeout(client: Client) -> None:
    with client.create() as sb:
        r = sb.exec("while :; do :; done", timeout=2)
        assert r.timed_out and r.exit_code == 137
        assert sb.exec("echo alive").stdout == b"alive\n"


@pytest.mark.parametrize(
    "action,final", [("delete", None), ("stop", "stopped"), ("pause", "paused")]
)
def test_ttl_action(client: Client, action: str, final: str | None) -> None:
    sb = client.create(ttl_seconds=2, ttl_action=action)  # type: ignore[arg-type]
    start = time.monotonic()
    assert sb.exec("echo hi").stdout == b"hi\n"
    while time.monotonic() - start < 15:
        try:
            state = client.get(sb.id).state
        except errors.NotFound:
            state = None
        if state == final:
            break
        time.sleep(0.1)
    elapsed = time.monotonic() - start
    assert state == final
    assert elapsed < 2 + 3  # acted within the stated bound: TTL + reaper interval + action
    if final is not None:
        kinds = [(e.type, e.data.get("limit")) for e in client.get(sb.id).events()]
        assert ("limit_hit", "ttl") in kinds
        client.get(sb.id).delete()


def test_idle_timeout_counts_from_the_last_activity(client: Client) -> None:
    sb = client.create(idle_timeout_seconds=2, idle_action="stop")  # type: ignore[arg-type]
    try:
        # a long exec is activity: the sandbox is not idle while it runs
        assert sb.exec("sleep 3; echo done", timeout=20).stdout == b"done\n"
        assert client.get(sb.id).state == "running"
        deadline = time.monotonic() + 10
        while client.get(sb.id).state != "stopped" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert client.get(sb.id).state == "stopped"
    finally:
        client.get(sb.id).delete()


def test_create_options_are_validated(client: Client) -> None:
    with pytest.raises(errors.InvalidArgument):
        client.create(ttl_seconds=0)
    with pytest.raises(errors.InvalidArgument):
        client.request("POST", "/v1/sandboxes", json={"ttl_action": "explode"})
    with pytest.raises(errors.InvalidArgument):
        client.request("POST", "/v1/sandboxes", json={"max_pids": 1})
