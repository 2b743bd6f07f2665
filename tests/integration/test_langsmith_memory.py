"""The LangSmith SDK's memory options (`langsmith==0.14.17`: its generated API client, which
carries them, beside the sandbox client) on a real daemon and real microVMs: a stop that
preserves memory keeps a process running across stop and start, a plain one ends it; a
snapshot with memory brings its processes into the sandboxes made from it, one without (or
a create that asks for none) boots from its disk; files survive every one of these."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
from langsmith._client import AsyncLangsmith, Langsmith
from langsmith._exceptions import APIStatusError
from langsmith.sandbox import Sandbox, SandboxClient

from tests.daemon import Daemon

pytestmark = pytest.mark.vm

# a process with an argument nothing else has: alive or not, whatever its pid is now (the
# pattern's brackets keep the shell that runs pgrep from matching itself)
KEEPER = "nohup sleep 4242 >/dev/null 2>&1 &"
ALIVE = "pgrep -f 'sleep [4]242' >/dev/null && echo alive || echo gone"
SLOW = 240.0  # a boot from a disk under TCG on a busy host


@pytest.fixture(scope="module")
def client(daemon: Daemon) -> Iterator[SandboxClient]:
    c = SandboxClient(api_endpoint=f"{daemon.url}/api/v2/sandboxes", api_key=daemon.admin_key)
    yield c
    c.close()


@pytest.fixture(scope="module")
def api(daemon: Daemon) -> Iterator[Langsmith]:
    # no retries: a create retried after a timeout would only meet its own name
    with Langsmith(
        api_key=daemon.admin_key, base_url=daemon.url, max_retries=0, timeout=SLOW + 30
    ) as c:
        yield c


def wait_box(api: Langsmith, name: str, **create: object) -> None:
    """A box made with the generated client, waited for as long as a boot may take."""
    api.sandboxes.boxes.create(name=name, extra_body={"timeout": SLOW}, **create)  # type: ignore[arg-type]


def stopped(client: SandboxClient, name: str) -> bool:
    """Whether the box reads as stopped once its stop (run in the background) is done."""
    for _ in range(600):
        if client.get_sandbox_status(name).status == "stopped":
            return True
        time.sleep(0.2)
    return False


def state(box: Sandbox) -> str:
    return box.run(f"cat /opt/note.txt; {ALIVE}").stdout


def test_a_stop_that_preserves_memory_keeps_processes(
    api: Langsmith, client: SandboxClient
) -> None:
    made = api.sandboxes.boxes.create(name="keeps", preserve_memory_on_stop=True)
    assert made.preserve_memory_on_stop is True
    plain = api.sandboxes.boxes.create(name="plain")
    assert plain.preserve_memory_on_stop is False
    for name in ("keeps", "plain"):
        box = client.get_sandbox(name)
        box.run(f"echo {name} > /opt/note.txt; {KEEPER}")
        assert state(box) == f"{name}\nalive\n"
        box.stop()
        assert stopped(client, name)
        box.start(timeout=int(SLOW))
    keeps, plain_box = client.get_sandbox("keeps"), client.get_sandbox("plain")
    assert state(keeps) == "keeps\nalive\n"  # the same processes ran on
    assert state(plain_box) == "plain\ngone\n"  # files kept, processes ended
    assert api.sandboxes.boxes.retrieve("keeps").preserve_memory_on_stop is True
    client.delete_sandbox("keeps")
    client.delete_sandbox("plain")


def test_snapshots_with_and_without_memory(
    api: Langsmith, client: SandboxClient, daemon: Daemon
) -> None:
    with client.sandbox(name="source") as source:
        source.run(f"echo source > /opt/note.txt; {KEEPER}")
        with_memory = api.sandboxes.boxes.create_snapshot(
            "source", body_name="with-memory", include_memory=True
        )
        # the sandbox client's capture says nothing of memory: LangSmith's default, none
        disk_only = client.capture_snapshot("source", "disk-only")
    assert with_memory.status == "ready" and (with_memory.memory_snapshot_size_bytes or 0) > 0
    shown = api.sandboxes.snapshots.retrieve(disk_only.id)
    assert shown.memory_snapshot_size_bytes is None

    # restore_memory left out: the memory when the snapshot has it, else the disk
    with client.sandbox(snapshot="with-memory", name="resumed") as box:
        assert state(box) == "source\nalive\n"
    with client.sandbox(snapshot="disk-only", name="booted", timeout=int(SLOW)) as box:
        assert state(box) == "source\ngone\n"

    # never: the disk alone, though the snapshot has memory
    wait_box(api, "never", snapshot="with-memory", restore_memory=False)
    assert state(client.get_sandbox("never")) == "source\ngone\n"
    client.delete_sandbox("never")

    # always: refused for a snapshot without memory, nothing made ...
    with pytest.raises(APIStatusError) as refused:
        api.sandboxes.boxes.create(name="always", snapshot="disk-only", restore_memory=True)
    assert refused.value.status_code == 422 and "without memory" in str(refused.value.body)
    assert "always" not in [b.name for b in client.list_sandboxes()]

    # ... and honoured for one with it (the async client, as an async caller makes it)
    async def always() -> None:
        async with AsyncLangsmith(
            api_key=daemon.admin_key, base_url=daemon.url, max_retries=0
        ) as aapi:
            made = await aapi.sandboxes.boxes.create(
                name="always", snapshot="with-memory", restore_memory=True
            )
            assert made.status == "ready"

    asyncio.run(always())
    assert state(client.get_sandbox("always")) == "source\nalive\n"
    client.delete_sandbox("always")
