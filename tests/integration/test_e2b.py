"""E2B's official SDK (`e2b==2.63.0`, pinned, in its own environment, unchanged) driving a
real daemon: it is pointed at cella by `E2B_API_URL`, `E2B_SANDBOX_URL` and a cella key."""

from __future__ import annotations

import json
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2
import pytest

from cella import Client, errors
from tests.daemon import Daemon
from tests.netservers import EchoHandler, Recorder, Servers, free_loopback_block
from tests.sdk_env import run_script, sdk_python

pytestmark = pytest.mark.vm
E2B = ["e2b==2.63.0"]


@pytest.fixture(scope="module")
def python() -> Path:
    return sdk_python("e2b-2.63.0", E2B)


@dataclass
class Api:
    """A plain-HTTP server on loopback that echoes what it is sent, reached from sandboxes
    as `api.e2b.test` (the operator's host table)."""

    addr: str
    seen: Recorder


@pytest.fixture(scope="module")
def api() -> Iterator[Api]:
    addr = f"{free_loopback_block()}.1"
    servers = Servers()
    seen = servers.start(EchoHandler, (addr, 80))
    yield Api(addr, seen)
    servers.close()


@pytest.fixture(scope="module")
def daemon_settings(api: Api) -> dict[str, str]:
    return {
        "pool_size": "1",
        "max_sandboxes_per_tenant": "8",
        "egress_hosts": json.dumps({"api.e2b.test": api.addr}),
    }


def e2b(python: Path, daemon: Daemon, script: str, key: str | None = None) -> Any:
    env = {
        "E2B_API_URL": daemon.url,
        "E2B_SANDBOX_URL": daemon.url,
        "E2B_API_KEY": key or daemon.admin_key,
    }
    preamble = "import json\nfrom e2b import *\n"
    return run_script(python, preamble + textwrap.dedent(script), env)


def test_create_with_metadata_env_and_timeout(python: Path, daemon: Daemon, admin: Client) -> None:
    got = e2b(
        python,
        daemon,
        """
        sb = Sandbox.create(
            metadata={"team": "red", "run": "7"}, envs={"FOO": "bar 1"}, timeout=120
        )
        info = sb.get_info()
        print(json.dumps({"id": sb.sandbox_id, "state": str(info.state.value),
                          "metadata": info.metadata, "cpu": info.cpu_count,
                          "memory": info.memory_mb, "template": info.template_id,
                          "left": (info.end_at - info.started_at).total_seconds()}))
        """,
    )
    assert got["state"] == "running" and got["template"] == "base"
    assert got["metadata"] == {"team": "red", "run": "7"}
    assert got["cpu"] == 1 and got["memory"] == 512
    assert 110 <= got["left"] <= 130  # the lifetime asked for
    sb = admin.get(got["id"])  # the same sandbox, seen through cella's own API
    assert sb.info.labels == {"team": "red", "run": "7"}
    assert sb.exec('printf %s "$FOO"').stdout == b"bar 1"  # envVars: every command's env
    sb.delete()


def test_list_filters_by_metadata_and_state_in_pages(python: Path, daemon: Daemon) -> None:
    got = e2b(
        python,
        daemon,
        """
        made = [Sandbox.create(metadata={"batch": "b1", "i": str(i)}) for i in range(3)]
        other = Sandbox.create(metadata={"batch": "b2"})
        made[0].pause()
        pager = Sandbox.list(query=SandboxQuery(metadata={"batch": "b1"}), limit=2)
        pages = []
        while pager.has_next:
            pages.append(sorted(s.metadata["i"] for s in pager.next_items()))
        paused = Sandbox.list(query=SandboxQuery(metadata={"batch": "b1"},
                                                 state=[SandboxState.PAUSED])).next_items()
        for sb in [*made, other]:
            sb.kill()
        print(json.dumps({"pages": pages, "paused": [s.metadata["i"] for s in paused]}))
        """,
    )
    assert [len(p) for p in got["pages"]] == [2, 1]
    assert sorted(i for page in got["pages"] for i in page) == ["0", "1", "2"]
    assert got["paused"] == ["0"]


def test_pause_then_connect_keeps_memory(python: Path, daemon: Daemon, admin: Client) -> None:
    sandbox_id = e2b(python, daemon, "print(json.dumps(Sandbox.create().sandbox_id))")
    sb = admin.get(sandbox_id)
    sb.exec("sh -c 'sleep 1000 >/dev/null 2>&1 &'")
    got = e2b(
        python,
        daemon,
        f"""
        sb = Sandbox.connect("{sandbox_id}")
        first = sb.get_info().state.value
        paused = sb.pause()
        again = sb.pause()  # already paused: False, not an error
        while_paused = Sandbox.get_info("{sandbox_id}").state.value
        back = Sandbox.connect("{sandbox_id}", timeout=600)
        print(json.dumps([first, paused, again, while_paused, back.get_info().state.value]))
        """,
    )
    assert got == ["running", True, False, "paused", "running"]
    assert b"sleep 1000" in sb.exec("ps -o args").stdout  # its processes went on
    sb.delete()


def test_set_timeout_is_enforced(python: Path, daemon: Daemon, admin: Client) -> None:
    sandbox_id = e2b(
        python,
        daemon,
        """
        sb = Sandbox.create(timeout=600)
        sb.set_timeout(2)
        print(json.dumps(sb.sandbox_id))
        """,
    )
    assert admin.get(sandbox_id).state == "running"  # the control: there before the timeout
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            admin.get(sandbox_id)
        except errors.NotFound:  # the reaper killed it
            break
        time.sleep(0.5)
    got = e2b(
        python,
        daemon,
        f"""
        try:
            Sandbox.get_info("{sandbox_id}")
            print(json.dumps("still there"))
        except NotFoundException:
            print(json.dumps("not found"))
        """,
    )
    assert got == "not found"


def test_set_timeout_is_held_to_the_bound_of_a_create(
    python: Path, daemon: Daemon, admin: Client
) -> None:
    got = e2b(
        python,
        daemon,
        """
        sb = Sandbox.create(timeout=600)
        before = sb.get_info().end_at
        out = {"id": sb.sandbox_id}
        try:
            sb.set_timeout(10**12)
            out["huge"] = "accepted"
        except SandboxException as e:
            out["huge"] = str(e)
        out["unchanged"] = sb.get_info().end_at == before
        sb.set_timeout(1200)  # the control: a timeout within the bound
        out["extended"] = (sb.get_info().end_at - before).total_seconds()
        print(json.dumps(out))
        """,
    )
    assert got["huge"].startswith("400") and "too long" in got["huge"], got["huge"]
    assert got["unchanged"] is True
    assert 590 <= got["extended"] <= 640  # 600 s more than the 600 it had
    ttl = admin.get(got["id"]).info.ttl_seconds
    # what the SDK would not send: each a 400 that says why, and nothing changes
    url = f"{daemon.url}/sandboxes/{got['id']}/timeout"
    headers = {"X-API-Key": daemon.admin_key, "Content-Type": "application/json"}
    for raw, why in (
        ('{"timeout": 1e20}', "too long"),
        ('{"timeout": 1e400}', "integer"),
        ('{"timeout": NaN}', "integer"),
        ('{"timeout": -5}', "at least 1"),
        ('{"timeout": "soon"}', "integer"),
        ("[]", ""),
    ):
        answer = httpx2.post(url, content=raw, headers=headers)
        assert answer.status_code in (400, 422), (raw, answer.status_code, answer.text)
        assert why in answer.json()["message"], (raw, answer.text)
    assert admin.get(got["id"]).info.ttl_seconds == ttl
    admin.get(got["id"]).delete()


def test_fork_and_snapshots(python: Path, daemon: Daemon, admin: Client) -> None:
    sandbox_id = e2b(python, daemon, "print(json.dumps(Sandbox.create().sandbox_id))")
    admin.get(sandbox_id).files.write("/root/state.txt", "prepared")
    got = e2b(
        python,
        daemon,
        f"""
        sb = Sandbox.connect("{sandbox_id}")
        sb.commands.run("sleep 900", background=True, user="root")
        forks = sb.fork(count=2)
        snap = sb.create_snapshot("prepared-env")
        disk = sb.create_snapshot("disk-only", mode="filesystem")
        from_disk = Sandbox.create(disk.snapshot_id)
        pager = Sandbox.list_snapshots(sandbox_id=sb.sandbox_id)
        listed = [s.snapshot_id for s in pager.next_items()]
        booted = Sandbox.create(snap.snapshot_id)
        print(json.dumps({{"forks": [f.sandbox_id for f in forks], "snap": snap.snapshot_id,
                           "names": snap.names, "listed": listed, "booted": booted.sandbox_id,
                           "from_disk": from_disk.sandbox_id, "disk": disk.snapshot_id}}))
        """,
    )
    # a filesystem-only snapshot boots from its disk: the files, not the processes (the
    # control: the full snapshot's sandbox has the `sleep` the source was running)
    cold = admin.get(got["from_disk"])
    assert cold.files.read("/root/state.txt") == b"prepared"
    assert cold.exec("pgrep -x sleep").exit_code == 1
    assert admin.get(got["booted"]).exec("pgrep -x sleep").exit_code == 0
    assert admin.get_snapshot(got["disk"]).info.memory is False
    cold.delete()
    assert len(got["forks"]) == 2 and got["snap"] in got["listed"]  # (the fork took one too)
    assert got["names"] == ["prepared-env"]
    for branch in [*got["forks"], got["booted"]]:
        assert admin.get(branch).files.read("/root/state.txt") == b"prepared"
        admin.get(branch).delete()
    admin.get(sandbox_id).delete()
    deleted = e2b(
        python,
        daemon,
        f"""print(json.dumps([Sandbox.delete_snapshot("{got["snap"]}"),
                              Sandbox.delete_snapshot("{got["snap"]}")]))""",
    )
    assert deleted == [True, False]


def test_errors_the_sdk_maps(python: Path, daemon: Daemon, admin: Client) -> None:
    tenant_key = admin.create_key("e2b-errors")["key"]
    got = e2b(
        python,
        daemon,
        """
        out = {}
        try:
            Sandbox.get_info("sb-0000000000000000")
        except NotFoundException as e:
            out["missing"] = "NotFoundException"
        out["kill_missing"] = Sandbox.kill("sb-0000000000000000")
        try:
            Sandbox.create(template="no-such-template")
        except SandboxException as e:
            out["template"] = [e.status_code, "no-such-template" in str(e)]
        try:
            Sandbox.create(metadata={"not a key": "x"})
        except SandboxException as e:
            out["metadata"] = str(e)[:3]
        try:
            Sandbox.create(mcp={"x": {}})
        except SandboxException as e:
            out["mcp"] = "not supported" in str(e)
        def default_templates():
            from e2b.api import ApiClient, handle_api_exception
            from e2b.api.client.api.templates import get_default_templates
            from e2b.connection_config import ConnectionConfig
            raise handle_api_exception(
                get_default_templates.sync_detailed(client=ApiClient(ConnectionConfig()))
            )
        for name, call in (("unserved", default_templates),
                           ("metrics", lambda: Sandbox.get_metrics("sb-0000000000000000"))):
            try:
                call()
            except Exception as e:  # what the SDK raises, with cella's words in it
                out[name] = [type(e).__name__, str(e)]
        try:
            Sandbox.list(api_key="ck_wrong").next_items()
        except AuthenticationException:
            out["auth"] = "AuthenticationException"
        print(json.dumps(out))
        """,
        key=tenant_key,
    )
    assert got["missing"] == "NotFoundException" and got["kill_missing"] is False
    assert got["template"] == [400, True]
    assert got["metadata"] == "400" and got["mcp"] is True
    assert got["auth"] == "AuthenticationException"
    # E2B calls cella does not serve are named in E2B's shape (not the SDK's KeyError)
    assert "not supported by cella: E2B's default templates" in got["unserved"][1], got
    assert "KeyError" not in got["unserved"][0]
    # metrics are served: a sandbox nobody has is the SDK's own not-found
    assert got["metrics"][0] == "SandboxNotFoundException", got["metrics"]
    # and the control: the same key works
    assert (
        e2b(
            python,
            daemon,
            "print(json.dumps(len(Sandbox.list().next_items())))",
            key=tenant_key,
        )
        == 0
    )


def test_the_async_sdk(python: Path, daemon: Daemon) -> None:
    got = e2b(
        python,
        daemon,
        """
        import asyncio
        async def main():
            sb = await AsyncSandbox.create(metadata={"async": "yes"})
            info = await sb.get_info()
            killed = await sb.kill()
            return [info.metadata, killed]
        print(json.dumps(asyncio.run(main())))
        """,
    )
    assert got == [{"async": "yes"}, True]


def test_commands_stream_take_stdin_fail_and_reattach(python: Path, daemon: Daemon) -> None:
    got = e2b(
        python,
        daemon,
        """
        out = {}
        sb = Sandbox.create()
        r = sb.commands.run("echo hi; whoami; pwd; echo oops >&2")
        out["run"] = [r.stdout, r.stderr, r.exit_code]
        out["root"] = sb.commands.run("whoami", user="root", cwd="/tmp").stdout
        seen = []
        sb.commands.run("for i in 1 2 3; do echo $i; sleep 0.2; done", on_stdout=seen.append)
        out["streamed"] = seen
        try:
            sb.commands.run("echo partial; exit 3")
        except CommandExitException as e:
            out["failed"] = [e.exit_code, e.stdout]
        h = sb.commands.run("read x; echo got:$x", background=True, stdin=True)
        sb.commands.send_stdin(h.pid, "hello\\n")
        out["stdin"] = h.wait().stdout
        bg = sb.commands.run("for i in $(seq 1 50); do echo tick$i; sleep 0.1; done; sleep 600",
                             background=True)
        bg.disconnect()
        again = sb.commands.connect(bg.pid)  # re-attached by pid: it ran on meanwhile
        out["listed"] = bg.pid in [p.pid for p in sb.commands.list()]
        import time
        time.sleep(1.0)  # ticks still come, now to the re-attached handle
        out["killed"] = [sb.commands.kill(bg.pid)]
        try:
            again.wait()
        except CommandExitException as e:
            out["reattached_end"] = ["tick" in e.stdout, e.exit_code]
        out["killed"].append(sb.commands.kill(bg.pid))  # it has ended: nothing to kill
        out["running"] = sb.is_running()
        sb.kill()
        out["after_kill"] = sb.is_running()
        print(json.dumps(out))
        """,
    )
    assert got["run"] == ["hi\nuser\n/home/user\n", "oops\n", 0]
    assert got["root"] == "root\n"
    assert got["streamed"] == ["1\n", "2\n", "3\n"]
    assert got["failed"] == [3, "partial\n"]
    assert got["stdin"] == "got:hello\n"
    assert got["listed"] is True and got["killed"] == [True, False]
    assert got["reattached_end"] == [True, -1]  # killed: no exit status of its own
    assert got["running"] is True and got["after_kill"] is False


def test_files(python: Path, daemon: Daemon) -> None:
    got = e2b(
        python,
        daemon,
        """
        import hashlib, io, os
        out = {}
        sb = Sandbox.create()
        info = sb.files.write("notes/a.txt", "relative to home")
        out["written"] = [info.path, info.type.value]
        out["read"] = sb.files.read("/home/user/notes/a.txt")
        out["owner"] = sb.commands.run("stat -c %U notes notes/a.txt").stdout.split()
        big = os.urandom(50 << 20)
        sb.files.write("/home/user/big.bin", io.BytesIO(big))  # octet-stream, streamed
        back = sb.files.read("/home/user/big.bin", format="bytes")
        same = hashlib.sha256(back).digest() == hashlib.sha256(big).digest()
        out["big"] = [len(back), same]
        sb.files.write("/home/user/z.txt", "zipped", gzip=True)
        out["gzip"] = sb.files.read("/home/user/z.txt")
        out["exists"] = [sb.files.exists("/home/user/z.txt"), sb.files.exists("/no/such")]
        out["mkdir"] = [sb.files.make_dir("/home/user/d/e"), sb.files.make_dir("/home/user/d/e")]
        entries = sb.files.list("/home/user/d", depth=2)
        out["list"] = sorted((e.path, e.type.value) for e in entries)
        out["rename"] = sb.files.rename("/home/user/z.txt", "/home/user/d/z.txt").path
        sb.files.remove("/home/user/d")
        out["removed"] = sb.files.exists("/home/user/d/z.txt")
        try:
            sb.files.read("/home/user/missing.txt")
        except FileNotFoundException:
            out["missing"] = "FileNotFoundException"
        entry = sb.files.get_info("/home/user/notes/a.txt")
        out["info"] = [entry.name, entry.size, entry.permissions, entry.owner]
        sb.kill()
        print(json.dumps(out))
        """,
    )
    assert got["written"] == ["/home/user/notes/a.txt", "file"]
    assert got["read"] == "relative to home"
    assert got["owner"] == ["user", "user"]  # made as the user the SDK acts as
    assert got["big"] == [50 << 20, True]
    assert got["gzip"] == "zipped"
    assert got["exists"] == [True, False]
    assert got["mkdir"] == [True, False]
    assert got["list"] == [["/home/user/d/e", "dir"]]
    assert got["rename"] == "/home/user/d/z.txt"
    assert got["removed"] is False
    assert got["missing"] == "FileNotFoundException"
    assert got["info"] == ["a.txt", 16, "-rw-r--r--", "user"]


def test_envd_refuses_a_wrong_token_and_unknown_sandboxes(python: Path, daemon: Daemon) -> None:
    sandbox_id = e2b(python, daemon, "print(json.dumps(Sandbox.create().sandbox_id))")
    detail = httpx2.get(
        f"{daemon.url}/sandboxes/{sandbox_id}", headers={"X-API-KEY": daemon.admin_key}
    ).json()

    def stat(sandbox: str, token: str) -> httpx2.Response:
        return httpx2.post(
            f"{daemon.url}/filesystem.Filesystem/Stat",
            json={"path": "/home/user"},
            headers={"E2b-Sandbox-Id": sandbox, "X-Access-Token": token},
        )

    good = stat(sandbox_id, detail["envdAccessToken"])
    assert good.status_code == 200 and good.json()["entry"]["type"] == "FILE_TYPE_DIRECTORY"
    forged = stat(sandbox_id, "forged")
    assert forged.status_code == 401 and forged.json()["code"] == "unauthenticated"
    other = stat("sb-0000000000000000", detail["envdAccessToken"])
    assert other.status_code == 502 and "was not found" in other.text
    got = e2b(
        python,
        daemon,
        f"""
        sb = Sandbox.connect("{sandbox_id}")
        sb.kill()
        try:
            sb.commands.run("true")
        except SandboxException as e:
            print(json.dumps(type(e).__name__))
        """,
    )
    assert got == "SandboxNotRunningException"


def test_the_async_sdk_runs_commands_and_files(python: Path, daemon: Daemon) -> None:
    got = e2b(
        python,
        daemon,
        """
        import asyncio
        async def main():
            sb = await AsyncSandbox.create()
            seen = []
            r = await sb.commands.run("echo a; echo b", on_stdout=seen.append)
            await sb.files.write("/home/user/x.txt", "async")
            text = await sb.files.read("/home/user/x.txt")
            await sb.kill()
            return [r.stdout, "".join(seen), text]
        print(json.dumps(asyncio.run(main())))
        """,
    )
    assert got == ["a\nb\n", "a\nb\n", "async"]


def test_watch_a_directory(python: Path, daemon: Daemon) -> None:
    got = e2b(
        python,
        daemon,
        """
        import asyncio, time
        out = {}
        sb = Sandbox.create()
        sb.files.make_dir("/home/user/w")
        handle = sb.files.watch_dir("/home/user/w")
        sb.files.write("/home/user/w/new.txt", "one")
        time.sleep(1)
        first = handle.get_new_events()
        # The watcher polls: each change is given time to be seen before the next.
        def until(kind):
            got = []
            for _ in range(100):
                got += handle.get_new_events()
                if any(e.type.value == kind for e in got):
                    break
                time.sleep(0.1)
            return got
        sb.commands.run("echo more >> /home/user/w/new.txt")
        later = until("write")
        sb.commands.run("rm /home/user/w/new.txt")
        later += until("remove")
        handle.stop()
        out["sync"] = [[e.name, e.type.value] for e in first + later]
        async def watch():
            a = await AsyncSandbox.connect(sb.sandbox_id)
            seen = []
            h = await a.files.watch_dir("/home/user/w", on_event=seen.append)
            await a.files.write("/home/user/w/b.txt", "b")
            for _ in range(50):
                if seen:
                    break
                await asyncio.sleep(0.1)
            await h.stop()
            return [[e.name, e.type.value] for e in seen]
        out["async"] = asyncio.run(watch())
        sb.kill()
        print(json.dumps(out))
        """,
    )
    kinds = [kind for _, kind in got["sync"]]
    assert got["sync"][0] == ["new.txt", "create"], got
    assert "write" in kinds and kinds[-1] == "remove"
    assert got["async"][:1] == [["b.txt", "create"]]


@pytest.fixture(scope="module")
def interpreter_python() -> Path:
    return sdk_python("e2b-code-interpreter-2.11.5", [*E2B, "e2b-code-interpreter==2.11.5"])


def test_the_code_interpreter(interpreter_python: Path, daemon: Daemon) -> None:
    """`e2b-code-interpreter` on a `code-interpreter` sandbox: results, output, errors, a
    matplotlib PNG, state kept between runs, contexts; contexts and code on a sandbox
    whose ports are private (the SDK's `/contexts` calls carry only its traffic token)."""
    got = e2b(
        interpreter_python,
        daemon,
        """
        import base64
        from e2b_code_interpreter import Sandbox as Interpreter
        out = {}
        sb = Interpreter.create()
        out["sum"] = sb.run_code("1+1").text
        seen = []
        ex = sb.run_code("x = 21\\nprint('hello')\\nx * 2", on_stdout=lambda m: seen.append(m.line))
        out["run"] = [ex.text, ex.logs.stdout, ex.execution_count > 0]
        out["streamed"] = seen
        out["state"] = sb.run_code("x").text
        err = sb.run_code("undefined_name").error
        out["error"] = [err.name, "undefined_name" in err.value]
        plot = sb.run_code(
            "import matplotlib.pyplot as plt\\nplt.plot([1, 2, 3], [1, 4, 9])\\nplt.show()"
        )
        png = [r.png for r in plot.results if r.png]
        out["png"] = base64.b64decode(png[0])[:8].hex() if png else None
        ctx = sb.create_code_context()
        out["context"] = [sb.run_code("x", context=ctx).error.name,
                          ctx.id in [c.id for c in sb.list_code_contexts()]]
        out["env"] = sb.run_code("import os; os.environ['TOKEN']", envs={"TOKEN": "t1"}).text
        sb.kill()
        private = Interpreter.create(network={"allow_public_traffic": False})
        ctx = private.create_code_context()
        out["private"] = [ctx.id in [c.id for c in private.list_code_contexts()],
                          private.run_code("6 * 7", context=ctx).text]
        private.kill()
        print(json.dumps(out))
        """,
    )
    assert got["sum"] == "2"
    assert got["run"] == ["42", ["hello\n"], True]
    assert got["streamed"] == ["hello\n"]
    assert got["state"] == "21"
    assert got["error"] == ["NameError", True]
    assert got["png"] == "89504e470d0a1a0a"  # a PNG's signature
    assert got["context"] == ["NameError", True]  # a new context has its own state
    assert got["env"] == "'t1'"
    assert got["private"] == [True, "42"]  # the SDK's own tokens, on a private sandbox too


def test_servers_in_the_sandbox_by_host_name(python: Path, daemon: Daemon) -> None:
    """`get_host(port)` names a server in the sandbox; the daemon routes that name to it:
    to anyone by E2B's default, only with the traffic token when public traffic is off
    (the probe without the token is refused where the same request with it passes)."""
    got = e2b(
        python,
        daemon,
        """
        import os, urllib.request, urllib.error
        base = os.environ["E2B_API_URL"]
        def fetch(host, path="/hello.txt", **headers):
            req = urllib.request.Request(base + path, headers={"Host": host, **headers})
            try:
                with urllib.request.urlopen(req, timeout=60) as r:
                    return [r.status, r.read().decode()]
            except urllib.error.HTTPError as e:
                return [e.code, ""]
        def serve(sb):
            sb.files.write("/home/user/hello.txt", "hi from " + sb.sandbox_id)
            sb.commands.run("python3 -m http.server 8000", background=True, cwd="/home/user")
            sb.commands.run("for i in $(seq 200); do curl -sf localhost:8000 >/dev/null && "
                            "break; sleep 0.1; done")
            return sb
        public = serve(Sandbox.create())
        guarded = serve(Sandbox.create(network={"allow_public_traffic": False}))
        token = guarded.traffic_access_token
        out = {
            "ids": [public.sandbox_id, guarded.sandbox_id],
            "host": public.get_host(8000),
            "public": fetch(public.get_host(8000)),
            "public_token": public.traffic_access_token,
            "no_token": fetch(guarded.get_host(8000)),
            "bad_token": fetch(guarded.get_host(8000), **{"E2B-Traffic-Access-Token": "x" * 43}),
            "token": fetch(guarded.get_host(8000), **{"E2B-Traffic-Access-Token": token}),
            "other_port": fetch(guarded.get_host(8001), **{"E2B-Traffic-Access-Token": token}),
            "envd": fetch(public.get_host(49983), "/health",
                          **{"X-Access-Token": public._envd_access_token}),
            "envd_no_token": fetch(public.get_host(49983), "/health"),
        }
        public.kill(); guarded.kill()
        print(json.dumps(out))
        """,
    )
    public, guarded = got["ids"]
    assert got["host"] == f"8000-{public}.localhost:{daemon.port}"
    assert got["public"] == [200, f"hi from {public}"]  # no token needed...
    assert got["public_token"]  # ...though one is handed out (the interpreter's /contexts)
    assert got["no_token"][0] == 403 and got["bad_token"][0] == 403
    assert got["token"] == [200, f"hi from {guarded}"]  # the control: same path, with token
    assert got["other_port"][0] == 502  # nothing listens there
    assert got["envd"][0] == 204 and got["envd_no_token"][0] == 401


def test_a_terminal(python: Path, daemon: Daemon) -> None:
    """`sandbox.pty`: an interactive login shell in a terminal that can be resized, takes
    input, and stops a running command on Ctrl-C (seen from outside: the `sleep` it runs is
    there, then gone). Markers are split with quotes so the terminal's echo of the input
    line cannot stand in for the command's output."""
    got = e2b(
        python,
        daemon,
        """
        import threading, time
        sb = Sandbox.create()
        seen = []
        h = sb.pty.create(PtySize(rows=24, cols=80), timeout=120)
        done = {}
        def read():
            done["exit"] = h.wait(on_pty=lambda d: seen.append(bytes(d))).exit_code
        reader = threading.Thread(target=read)
        reader.start()
        def sleeping():
            try:
                return sb.commands.run("pgrep -x sleep", user="root").exit_code == 0
            except CommandExitException:
                return False
        def waits_for(want):  # at most ~30 s, far less than the sleep's 600
            for _ in range(150):
                if sleeping() == want:
                    return True
                time.sleep(0.1)
            return False
        sb.pty.resize(h.pid, PtySize(rows=40, cols=100))
        sb.pty.send_stdin(h.pid, b"stty size; echo $((6*7)); tty\\n")
        sb.pty.send_stdin(h.pid, b"sleep 600\\n")
        started = waits_for(True)  # the control: the terminal's command runs
        sb.pty.send_stdin(h.pid, b"\\x03")
        stopped = waits_for(False)  # and Ctrl-C ends it
        sb.pty.send_stdin(h.pid, b"echo af''ter; exit\\n")
        reader.join(120)
        text = b"".join(seen).decode(errors="replace")
        sb.kill()
        print(json.dumps({"text": text, "started": started, "stopped": stopped,
                          "exit": done.get("exit")}))
        """,
    )
    text = got["text"]
    assert got["started"] and got["stopped"] and got["exit"] == 0, got
    assert "40 100" in text and "42" in text and "/dev/pts/" in text
    assert "after" in text


@pytest.fixture(scope="module")
def older_python() -> Path:
    return sdk_python("e2b-2.20.0", ["e2b==2.20.0"])


def test_an_older_client(older_python: Path, daemon: Daemon) -> None:
    """E2B's SDK 2.20 (a year older than the pinned one) on the same daemon."""
    got = e2b(
        older_python,
        daemon,
        """
        sb = Sandbox.create(metadata={"sdk": "2.20"})
        out = {"run": sb.commands.run("echo $((6*7)) && whoami").stdout}
        sb.files.write("/home/user/a.txt", "from 2.20")
        out["read"] = sb.files.read("/home/user/a.txt")
        out["listed"] = [s.metadata for s in Sandbox.list(
            query=SandboxQuery(metadata={"sdk": "2.20"})).next_items()]
        bg = sb.commands.run("sleep 30", background=True)
        out["killed"] = sb.commands.kill(bg.pid)
        sb.kill()
        print(json.dumps(out))
        """,
    )
    assert got["run"] == "42\nuser\n"
    assert got["read"] == "from 2.20"
    assert got["listed"] == [{"sdk": "2.20"}] and got["killed"] is True


def test_secrets_header_rules_and_live_network(python: Path, daemon: Daemon, api: Api) -> None:
    """E2B's `/secrets` API keeps a secret (versions, metadata, never its value in an
    answer); a sandbox's `network.rules` header transform names it, and the proxy puts it in
    as the request leaves; `update_network` replaces the rules of the running sandbox."""
    got = e2b(
        python,
        daemon,
        """
        from e2b.api import ApiClient
        from e2b.connection_config import ConnectionConfig
        from e2b.api.client.api.secrets import (post_secrets, get_secrets,
            get_secrets_secret_id, post_secrets_secret_id, delete_secrets_secret_id)
        from e2b.api.client.models import NewSecret, SecretUpdate
        api = ApiClient(ConnectionConfig())
        out = {}
        new = lambda name, value: post_secrets.sync_detailed(
            client=api, body=NewSecret(name=name, value=value))
        made = new("Token", "v1-s3cret")
        out["made"] = [made.status_code, json.loads(made.content)]
        out["dup"] = new("token", "x").status_code
        upd = post_secrets_secret_id.sync_detailed(
            "sec_token", client=api, body=SecretUpdate(value="v2-s3cret"))
        out["updated"] = json.loads(upd.content)
        out["listed"] = json.loads(get_secrets.sync_detailed(client=api).content)
        by_name = get_secrets_secret_id.sync_detailed("token", client=api)
        out["by_name"] = json.loads(by_name.content)
        rules = {"api.e2b.test": [{"transform": {"headers": {
            "Authorization": "Bearer ${e2b.secrets.token}", "X-Plain": "literal"}}}]}
        sb = Sandbox.create(network={"allow_out": ["api.e2b.test"], "rules": rules})
        curl = "curl -s -m 20 -H 'Authorization: Bearer guess' http://api.e2b.test/"
        out["with_rule"] = sb.commands.run(curl + "one").stdout
        out["env"] = sb.commands.run("env; cat /proc/1/environ 2>/dev/null", user="root").stdout
        sb.update_network({"allow_out": ["api.e2b.test"]})  # the rules cleared
        out["without_rule"] = sb.commands.run(curl + "two").stdout
        sb.update_network({})  # everything cleared: nothing is reachable
        code = "-o /dev/null -w '%{http_code}'"
        r = sb.commands.run(f"curl -s -m 20 {code} http://api.e2b.test/three || true")
        out["closed"] = r.stdout
        sb.kill()
        out["deleted"] = delete_secrets_secret_id.sync_detailed("sec_token", client=api).status_code
        out["gone"] = get_secrets_secret_id.sync_detailed("token", client=api).status_code
        print(json.dumps(out))
        """,
    )
    status, made = got["made"]
    assert status == 201 and made["name"] == "token" and made["secretID"] == "sec_token"
    assert made["currentVersion"] == 1 and "value" not in made
    assert got["dup"] == 409
    assert got["updated"]["currentVersion"] == 2
    assert [s["name"] for s in got["listed"]] == ["token"] and got["by_name"]["currentVersion"] == 2
    assert "s3cret" not in json.dumps(got["listed"]) + json.dumps(got["updated"])
    # the server saw the secret's current value, put in by the proxy over the guest's own
    seen = {r["path"]: r["headers"] for r in api.seen.requests}
    assert seen["/one"]["authorization"] == "Bearer v2-s3cret"
    assert seen["/one"]["x-plain"] == "literal"
    assert "s3cret" not in got["with_rule"] + got["env"]  # never inside the sandbox
    # the control: with the rule gone the guest's own header goes through untouched
    assert seen["/two"]["authorization"] == "Bearer guess" and "x-plain" not in seen["/two"]
    assert "/three" not in seen and got["closed"] != "200"
    assert got["deleted"] == 204 and got["gone"] == 404
