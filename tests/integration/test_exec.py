"""Exec on a real microVM (shared by this module; every test leaves it as it found it), and
through a real daemon with the SDK."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from cella import Client, errors
from cella.guest.client import ExecControl, Output, Started
from cella.guest.protocol import ExitStatus
from cella.runtime.qemu.vm import QemuVM
from tests.daemon import Daemon

pytestmark = pytest.mark.vm


async def test_guest_has_its_own_kernel_and_init(vm: QemuVM) -> None:
    import platform

    r = await vm.agent.exec(["uname", "-r"])
    guest_kernel = r.stdout.decode().strip()
    assert guest_kernel.endswith("-cella")  # built from microvm.config
    assert guest_kernel != platform.release()
    init = await vm.agent.read_file("/proc/1/cmdline")
    assert init == b"/init\x00"
    assert vm.accel in ("kvm", "tcg") and vm.accel_reason


async def test_exit_codes_and_signals(vm: QemuVM) -> None:
    assert (await vm.agent.exec("exit 0")).exit_code == 0
    assert (await vm.agent.exec(["false"])).exit_code == 1
    killed = await vm.agent.exec("kill -9 $$")
    assert (killed.exit_code, killed.signal, killed.timed_out) == (137, 9, False)


async def test_stdout_and_stderr_kept_apart(vm: QemuVM) -> None:
    r = await vm.agent.exec("echo out; echo err >&2; echo out2")
    assert r.stdout == b"out\nout2\n"
    assert r.stderr == b"err\n"


async def test_output_streams_as_produced(vm: QemuVM) -> None:
    arrivals: list[tuple[float, bytes]] = []
    script = "for i in 1 2 3 4 5; do echo line$i; sleep 0.2; done"
    async for event in vm.agent.exec_stream(script):
        if isinstance(event, Output):
            arrivals.append((time.monotonic(), event.data))
    assert b"".join(d for _, d in arrivals) == b"".join(b"line%d\n" % i for i in range(1, 6))
    # line by line: five separate chunks, spread over the ~0.8 s the loop sleeps
    assert len(arrivals) == 5
    assert arrivals[-1][0] - arrivals[0][0] >= 0.6


async def test_stream_event_order(vm: QemuVM) -> None:
    events = [e async for e in vm.agent.exec_stream(["echo", "hi"])]
    assert isinstance(events[0], Started) and events[0].pid > 1
    assert isinstance(events[-1], ExitStatus)
    assert events[1:-1] == [Output("stdout", b"hi\n")]


async def test_concurrent_execs_get_their_own_output(vm: QemuVM) -> None:
    async def one(i: int) -> tuple[int, bytes, bytes]:
        r = await vm.agent.exec(f"echo start-{i}; sleep 0.3; echo end-{i}; echo e{i} >&2")
        return i, r.stdout, r.stderr

    results = await asyncio.gather(*(one(i) for i in range(10)))
    for i, out, err in results:
        assert out == f"start-{i}\nend-{i}\n".encode()
        assert err == f"e{i}\n".encode()


async def test_stdin_reaches_the_process(vm: QemuVM) -> None:
    r = await vm.agent.exec(["cat"], stdin=b"hello\nworld\n")
    assert r.stdout == b"hello\nworld\n"
    big = bytes(range(256)) * 8192  # 2 MiB, more than any pipe buffer
    r = await vm.agent.exec(["sha256sum"], stdin=big)
    import hashlib

    assert r.stdout.split()[0].decode() == hashlib.sha256(big).hexdigest()


async def test_timeout_kills_the_whole_tree(vm: QemuVM) -> None:
    start = time.monotonic()
    r = await vm.agent.exec("setsid sleep 61 & sleep 60", timeout=2)
    assert r.timed_out and r.signal == 9 and r.exit_code == 137
    assert time.monotonic() - start < 30
    # neither the command nor the child that escaped into its own session survives
    left = await vm.agent.exec("pgrep -x sleep || true")
    assert left.stdout == b""


async def test_env_cwd_and_user(vm: QemuVM) -> None:
    r = await vm.agent.exec('echo "$FOO $(pwd)"', env={"FOO": "bar baz"}, cwd="/tmp")
    assert r.stdout == b"bar baz /tmp\n"
    r = await vm.agent.exec(["id", "-u"], user="nobody")
    assert r.stdout == b"65534\n"
    with pytest.raises(errors.UnknownUser):
        await vm.agent.exec(["true"], user="no-such-user")
    with pytest.raises(errors.NotFound):
        await vm.agent.exec(["true"], cwd="/no/such/dir")
    with pytest.raises(errors.NotFound):
        await vm.agent.exec(["/no/such/binary"])


async def test_non_utf8_bytes_round_trip(vm: QemuVM) -> None:
    r = await vm.agent.exec(["printf", "\\377\\376abc\\200"])
    assert r.stdout == b"\xff\xfeabc\x80"
    odd = b"\xff\xfe".decode("utf-8", "surrogateescape")
    r = await vm.agent.exec(["printf", "%s", odd])
    assert r.stdout == b"\xff\xfe"


async def test_background_process_outlives_its_exec(vm: QemuVM) -> None:
    # the exec returns although the child still holds its stdout open
    r = await vm.agent.exec("sleep 300 & echo started", timeout=20)
    assert not r.timed_out and r.stdout == b"started\n"
    alive = await vm.agent.exec(["pgrep", "-x", "sleep"])
    assert alive.exit_code == 0
    await vm.agent.exec("pkill -x sleep")


async def test_invalid_requests_are_clear_errors(vm: QemuVM) -> None:
    # requests are validated by their API models (tests/unit/test_models.py); the guest
    # agent refuses what is malformed on its own too, and answers afterwards
    with pytest.raises(errors.InvalidArgument):
        await vm.agent.exec([])
    assert (await vm.agent.exec(["true"])).exit_code == 0


async def test_abandoned_stream_kills_its_process(vm: QemuVM) -> None:
    stream = vm.agent.exec_stream(["sleep", "120"])
    started = await anext(stream)
    assert isinstance(started, Started)
    for _ in range(50):  # control: the sleep is seen running before the stream is dropped
        if (await vm.agent.exec(["pgrep", "-x", "sleep"])).exit_code == 0:
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError("the streamed sleep never ran")
    await stream.aclose()
    for _ in range(50):
        r = await vm.agent.exec(["pgrep", "-x", "sleep"])
        if r.exit_code == 1:
            break
        await asyncio.sleep(0.1)
    assert r.exit_code == 1


async def test_a_terminal_exec_with_resize_and_eof(vm: QemuVM) -> None:
    control = ExecControl()
    stdin: asyncio.Queue[bytes | None] = asyncio.Queue()

    async def typed() -> AsyncIterator[bytes]:
        while (chunk := await stdin.get()) is not None:
            yield chunk

    script = "tty; stty size; read line; echo got:$line; stty size; cat; echo done"
    out = b""
    async for event in vm.agent.exec_stream(
        ["sh", "-c", script], stdin=typed(), pty=(100, 30), control=control
    ):
        if isinstance(event, Output):
            assert event.stream == "stdout"  # a terminal has one output
            out += event.data
            if b"30 100" in out and b"got:" not in out:
                await control.resize(120, 40)
                await stdin.put(b"hello\n")
            if b"40 120" in out and b"done" not in out:
                await stdin.put(None)  # the EOF character ends `cat`
        elif isinstance(event, ExitStatus):
            assert event.exit_code == 0, out
    text = out.decode()
    assert "/dev/pts/" in text and "got:hello" in text and "done" in text


async def test_signals_reach_a_running_exec(vm: QemuVM) -> None:
    control = ExecControl()
    status = None
    async for event in vm.agent.exec_stream(
        "trap 'echo term; exit 3' TERM; echo ready; while true; do sleep 0.1; done",
        control=control,
    ):
        if isinstance(event, Output) and b"ready" in event.data:
            await control.kill(15)
        elif isinstance(event, ExitStatus):
            status = event
    assert status is not None and status.exit_code == 3


async def test_the_host_reaches_a_server_in_the_guest(vm: QemuVM) -> None:
    server = await vm.agent.exec(
        [
            "bash",
            "-c",
            "nohup python3 -m http.server 8765 --bind 127.0.0.1 >/dev/null 2>&1 & "
            "for i in $(seq 200); do (echo > /dev/tcp/127.0.0.1/8765) 2>/dev/null && exit 0; "
            "sleep 0.1; done; exit 1",
        ],
        timeout=60,
    )
    try:
        assert server.exit_code == 0
        stream = await vm.agent.open_port(8765)
        await stream.write(b"GET / HTTP/1.0\r\n\r\n")
        await stream.write_eof()
        reply = b""
        while chunk := await stream.read():
            reply += chunk
        await stream.close()
        assert reply.startswith(b"HTTP/1.0 200") and b"Directory listing" in reply
        with pytest.raises(errors.GuestError, match="refused"):
            await vm.agent.open_port(8766)  # nothing listens there
    finally:
        await vm.agent.exec("pkill -f 'http.server 8765'")


# -- through the daemon and the SDK ---------------------------------------------------------


def test_a_command_outlasting_the_client_timeout_returns_its_result(
    daemon: Daemon, admin: Client
) -> None:
    """A request that runs a command waits as long as the command may run, whatever the
    client's own timeout (here 2 s); the command's own timeout still ends it."""
    with admin.create() as sb, daemon.client(timeout=2) as short:
        quick = short.get(sb.id)  # other requests keep the 2 s
        done = quick.exec("sleep 4; echo done", timeout=60)
        assert (done.exit_code, done.stdout) == (0, b"done\n") and done.duration_ms >= 4000
        untimed = quick.exec("sleep 4; echo untimed")  # no command timeout: no read limit
        assert untimed.stdout == b"untimed\n"
        streamed = list(quick.exec_stream("sleep 4; echo streamed", timeout=60))
        assert streamed[-1].type == "exit" and streamed[-2].bytes == b"streamed\n"
        # the control: the command's own timeout ends it, and that is the answer
        ended = quick.exec("sleep 30", timeout=3)
        assert ended.timed_out and 3000 <= ended.duration_ms < 10_000
