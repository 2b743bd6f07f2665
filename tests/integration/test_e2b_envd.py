"""E2B's envd as current SDKs expect it, driven by the pinned SDK (`e2b==2.63.0`, sync and
async) against a real daemon: the envd version it gates features on, file metadata kept as
extended attributes in the guest, symlinks, envd's own errors, signed file URLs, watches
with entries that see directories made later, command-scoped environments, a command's
stream ending when its sandbox is killed, list filters over running and paused sandboxes,
the sandbox domain, and keys in the form the SDKs that check one accept (`e2b==2.45.0`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import httpx2
import pytest

from cella import Client
from tests.daemon import Daemon
from tests.sdk_env import run_script, sdk_python

pytestmark = pytest.mark.vm
E2B = ["e2b==2.63.0"]


@pytest.fixture(scope="module")
def python() -> Path:
    return sdk_python("e2b-2.63.0", E2B)


@pytest.fixture(scope="module")
def daemon_settings() -> dict[str, str]:
    return {"pool_size": "1", "max_sandboxes_per_tenant": "8"}


def e2b(python: Path, daemon: Daemon, script: str, key: str | None = None) -> Any:
    env = {
        "E2B_API_URL": daemon.url,
        "E2B_SANDBOX_URL": daemon.url,
        "E2B_API_KEY": key or daemon.admin_key,
    }
    preamble = "import json\nfrom e2b import *\n"
    return run_script(python, preamble + textwrap.dedent(script), env)


def test_file_metadata_symlinks_and_envds_errors(python: Path, daemon: Daemon) -> None:
    got = e2b(
        python,
        daemon,
        """
        import asyncio
        out = {}
        sb = Sandbox.create()
        out["envd"] = str(sb._envd_version)
        meta = {"Content-Type": "text/plain", "owner": "red"}
        out["written"] = sb.files.write("/home/user/m/a.txt", "one", metadata=meta).metadata
        out["info"] = sb.files.get_info("/home/user/m/a.txt").metadata
        out["listed"] = {e.name: e.metadata for e in sb.files.list("/home/user/m")}
        out["xattr"] = sb.commands.run(
            "python3 -c \\"import os; p='/home/user/m/a.txt'; "
            "print(sorted((k, os.getxattr(p, k).decode()) for k in os.listxattr(p)))\\""
        ).stdout.strip()
        out["renamed"] = sb.files.rename("/home/user/m/a.txt", "/home/user/m/b.txt").metadata
        sb.files.write("/home/user/m/b.txt", "two")  # an overwrite without metadata
        out["overwritten"] = sb.files.get_info("/home/user/m/b.txt").metadata
        sb.files.write("/home/user/m/b.txt", "three", metadata={"k": "v2"})
        out["replaced"] = sb.files.get_info("/home/user/m/b.txt").metadata
        try:  # a key over envd's bound (the SDK checks only the characters)
            sb.files.write("/home/user/m/c.txt", "x", metadata={"k" * 247: "v"})
            out["too_long"] = "accepted"
        except SandboxException as e:
            out["too_long"] = [type(e).__name__, str(e)]
        out["not_written"] = sb.files.exists("/home/user/m/c.txt")
        sb.commands.run("cd /home/user/m && ln -s $PWD/b.txt link && ln -s /nowhere dangling")
        link = sb.files.get_info("/home/user/m/link")
        out["link"] = [link.type.value, link.symlink_target]
        out["listed_links"] = sorted(
            [e.name, e.type.value, e.symlink_target] for e in sb.files.list("/home/user/m")
        )
        sb.files.remove("/home/user/m/never-was")  # envd: nothing to remove is no error
        out["removed_missing"] = True
        sb.files.remove("/home/user/m/dangling")
        out["removed"] = sb.files.exists("/home/user/m/dangling")
        for name, call in (("list_missing", lambda: sb.files.list("/home/user/nope")),
                           ("list_file", lambda: sb.files.list("/home/user/m/b.txt")),
                           ("info_missing", lambda: sb.files.get_info("/home/user/nope"))):
            try:
                call()
                out[name] = "no error"
            except SandboxException as e:
                out[name] = [type(e).__name__, str(e)]
        async def other():
            a = await AsyncSandbox.connect(sb.sandbox_id)
            w = await a.files.write("/home/user/m/async.txt", "a", metadata={"from": "async"})
            info = await a.files.get_info("/home/user/m/async.txt")
            listed = {e.name: e.metadata for e in await a.files.list("/home/user/m")}
            return [w.metadata, info.metadata, listed["async.txt"]]
        out["async"] = asyncio.run(other())
        sb.kill()
        print(json.dumps(out))
        """,
    )
    assert tuple(int(p) for p in got["envd"].split(".")) >= (0, 6, 4)
    meta = {"content-type": "text/plain", "owner": "red"}  # keys lower-cased, as envd does
    assert got["written"] == meta and got["info"] == meta
    assert got["listed"] == {"a.txt": meta}
    # kept in the guest as the file's own extended attributes
    assert got["xattr"] == str([("user.e2b.content-type", "text/plain"), ("user.e2b.owner", "red")])
    assert got["renamed"] == meta  # kept on rename
    assert got["overwritten"] is None  # cleared on overwrite...
    assert got["replaced"] == {"k": "v2"}  # ...and replaced by the new upload's
    assert got["too_long"][0] == "InvalidArgumentException" and "246" in got["too_long"][1]
    assert got["not_written"] is False
    assert got["link"] == ["symlink", "/home/user/m/b.txt"]
    links = {name: [kind, target] for name, kind, target in got["listed_links"]}
    assert links["link"] == ["symlink", "/home/user/m/b.txt"]
    assert links["dangling"] == ["symlink", "/nowhere"] and links["b.txt"] == ["file", None]
    assert got["removed_missing"] is True and got["removed"] is False
    assert got["list_missing"][0] == "FileNotFoundException"
    assert "directory not found" in got["list_missing"][1]
    assert got["list_file"][0] == "InvalidArgumentException"
    assert "path is not a directory" in got["list_file"][1]
    assert got["info_missing"][0] == "FileNotFoundException"
    assert got["async"] == [{"from": "async"}] * 3


def test_signed_file_urls(python: Path, daemon: Daemon) -> None:
    """`download_url`/`upload_url` of a secured sandbox, reached at its envd host name with
    no token: a valid signature works (the control), an expired or altered one is refused."""
    got = e2b(
        python,
        daemon,
        """
        import os, urllib.parse
        sb = Sandbox.create()
        sb.files.write("/home/user/s.txt", "signed")
        host = sb.get_host(49983)
        def parts(url):
            u = urllib.parse.urlsplit(url)
            return u.path + "?" + u.query
        print(json.dumps({
            "id": sb.sandbox_id, "host": host,
            "download": parts(sb.download_url("/home/user/s.txt", use_signature_expiration=120)),
            "forever": parts(sb.download_url("/home/user/s.txt")),
            "expired": parts(sb.download_url("/home/user/s.txt", use_signature_expiration=-5)),
            "upload": parts(sb.upload_url("/home/user/up.txt", use_signature_expiration=120)),
            "other": parts(sb.download_url("/etc/shadow", use_signature_expiration=120)),
        }))
        """,
    )

    def call(method: str, target: str, **kw: Any) -> httpx2.Response:
        return httpx2.request(method, daemon.url + target, headers={"Host": got["host"]}, **kw)

    ok = call("GET", got["download"])
    assert ok.status_code == 200 and ok.text == "signed"
    assert call("GET", got["forever"]).text == "signed"  # signed without an expiry
    expired = call("GET", got["expired"])
    assert expired.status_code == 401 and "expired" in expired.json()["message"]
    assert expired.json()["code"] == 401  # envd's error shape
    altered = call("GET", got["download"].replace("s.txt", "t.txt"))
    assert altered.status_code == 401 and altered.json()["message"] == "invalid signature"
    # a signature for one path opens no other: the same query with another path's
    swapped = (
        got["download"].split("signature=")[0] + "signature=" + got["other"].split("signature=")[1]
    )
    assert call("GET", swapped).status_code == 401
    assert call("GET", "/files?path=/home/user/s.txt").status_code == 401  # nothing signed
    up = call("POST", got["upload"], files={"file": ("up.txt", b"uploaded")})
    assert up.status_code == 200 and up.json()[0]["path"] == "/home/user/up.txt"
    # a read URL does not write
    write_with_read = call("POST", got["download"], files={"file": ("s.txt", b"x")})
    assert write_with_read.status_code == 401
    back = e2b(
        python,
        daemon,
        f"""
        sb = Sandbox.connect("{got["id"]}")
        out = [sb.files.read("/home/user/up.txt"), sb.files.read("/home/user/s.txt")]
        sb.kill()
        print(json.dumps(out))
        """,
    )
    assert back == ["uploaded", "signed"]


def test_recursive_watch_with_entries(python: Path, daemon: Daemon) -> None:
    got = e2b(
        python,
        daemon,
        """
        import asyncio, time
        sb = Sandbox.create()
        sb.files.make_dir("/home/user/w")
        handle = sb.files.watch_dir("/home/user/w", recursive=True, include_entry=True)
        sb.files.make_dir("/home/user/w/later")  # made after the watch started
        def until(name, kind):
            seen = []
            for _ in range(200):
                seen += handle.get_new_events()
                if any(e.name == name and e.type.value == kind for e in seen):
                    break
                time.sleep(0.1)
            return seen
        seen = until("later", "create")
        sb.files.write("/home/user/w/later/deep.txt", "deep")
        seen += until("later/deep.txt", "create")
        sb.files.remove("/home/user/w/later/deep.txt")
        seen += until("later/deep.txt", "remove")
        handle.stop()
        def shown(e):
            return [e.name, e.type.value,
                    [e.entry.path, e.entry.type.value, e.entry.size] if e.entry else None]
        out = {"sync": [shown(e) for e in seen]}
        async def watch():
            a = await AsyncSandbox.connect(sb.sandbox_id)
            events = []
            h = await a.files.watch_dir("/home/user/w", on_event=events.append,
                                        recursive=True, include_entry=True)
            await a.files.make_dir("/home/user/w/b")
            await a.files.write("/home/user/w/b/x.txt", "xy")
            for _ in range(200):
                if any(e.name == "b/x.txt" for e in events):
                    break
                await asyncio.sleep(0.1)
            await h.stop()
            plain = []
            h2 = await a.files.watch_dir("/home/user/w", on_event=plain.append)
            await a.files.write("/home/user/w/y.txt", "y")
            for _ in range(200):
                if plain:
                    break
                await asyncio.sleep(0.1)
            await h2.stop()
            return [[shown(e) for e in events], [shown(e) for e in plain]]
        out["async"], out["plain"] = asyncio.run(watch())
        sb.kill()
        print(json.dumps(out))
        """,
    )
    sync = got["sync"]
    later = [e for e in sync if e[0] == "later"]
    assert later[0][1] == "create" and later[0][2][:2] == ["/home/user/w/later", "dir"], sync
    deep = [e for e in sync if e[0] == "later/deep.txt"]
    assert deep[0] == ["later/deep.txt", "create", ["/home/user/w/later/deep.txt", "file", 4]]
    assert deep[-1] == ["later/deep.txt", "remove", None]  # a removal carries no entry
    assert ["b/x.txt", "create", ["/home/user/w/b/x.txt", "file", 2]] in got["async"]
    assert got["plain"][0] == ["y.txt", "create", None]  # the control: none when not asked


def test_command_envs_and_a_killed_sandbox_ends_the_stream(python: Path, daemon: Daemon) -> None:
    got = e2b(
        python,
        daemon,
        """
        import asyncio, os, threading, time
        out = {}
        sb = Sandbox.create(envs={"BOTH": "sandbox"})
        cmd = 'printf "%s|%s" "$ONLY" "$BOTH"'
        out["scoped"] = sb.commands.run(cmd, envs={"ONLY": "cmd", "BOTH": "cmd"}).stdout
        out["unscoped"] = sb.commands.run(cmd).stdout  # the control: not kept after
        handle = sb.commands.run("echo started; sleep 600", background=True)
        ended = {}
        def wait():
            t = time.monotonic()
            try:
                ended["result"] = handle.wait().exit_code
            except Exception as e:
                ended["result"] = type(e).__name__
            ended["seconds"] = time.monotonic() - t
        waiter = threading.Thread(target=wait, daemon=True)
        waiter.start()
        time.sleep(1)
        Sandbox.kill(sb.sandbox_id)
        waiter.join(120)
        out["sync"] = [ended.get("result", "hung"), waiter.is_alive()]
        async def killed():
            a = await AsyncSandbox.create()
            r = await a.commands.run(cmd, envs={"ONLY": "async"})
            h = await a.commands.run("sleep 600", background=True)
            task = asyncio.create_task(h.wait())
            await asyncio.sleep(1)
            await AsyncSandbox.kill(a.sandbox_id)
            try:
                await asyncio.wait_for(task, 120)
                return [r.stdout, "exited"]
            except asyncio.TimeoutError:
                return [r.stdout, "hung"]
            except Exception as e:
                return [r.stdout, type(e).__name__]
        out["async"] = asyncio.run(killed())
        print(json.dumps(out))
        """,
    )
    assert got["scoped"] == "cmd|cmd"
    assert got["unscoped"] == "|sandbox"
    # ended, not hung: as on E2B, the sandbox is reported gone
    assert got["sync"] == ["SandboxNotRunningException", False], got
    assert got["async"] == ["async|", "SandboxNotRunningException"], got


def test_list_started_after_and_pages_over_running_and_paused(python: Path, daemon: Daemon) -> None:
    got = e2b(
        python,
        daemon,
        """
        import datetime
        first = Sandbox.create(metadata={"batch": "sa"})
        later = [Sandbox.create(metadata={"batch": "sa"}) for _ in range(2)]
        since = later[0].get_info().started_at
        later[1].pause()
        q = SandboxQuery(metadata={"batch": "sa"}, started_after=since,
                         state=[SandboxState.RUNNING, SandboxState.PAUSED])
        pager = Sandbox.list(query=q, limit=1)
        pages = []
        while pager.has_next:
            pages.append([[s.sandbox_id, s.state.value] for s in pager.next_items()])
        everything = Sandbox.list(query=SandboxQuery(metadata={"batch": "sa"})).next_items()
        future = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(hours=1)
        none = Sandbox.list(query=SandboxQuery(started_after=future)).next_items()
        out = {"first": first.sandbox_id, "later": [s.sandbox_id for s in later],
               "pages": pages, "all": len(everything), "none": len(none),
               "domain": [first.sandbox_domain, Sandbox.connect(first.sandbox_id).sandbox_domain]}
        for sb in [first, *later]:
            sb.kill()
        print(json.dumps(out))
        """,
    )
    assert [len(p) for p in got["pages"]] == [1, 1]  # one a page, a token between them
    listed = {sid: state for page in got["pages"] for sid, state in page}
    assert listed == {got["later"][0]: "running", got["later"][1]: "paused"}
    assert got["first"] not in listed and got["all"] == 3  # the control: all three are there
    assert got["none"] == 0
    assert got["domain"] == [f"localhost:{daemon.port}"] * 2  # as create and connect set it


@pytest.fixture(scope="module")
def older_python() -> Path:
    return sdk_python("e2b-2.45.0", ["e2b==2.45.0"])


def test_keys_in_e2bs_form(older_python: Path, daemon: Daemon, admin: Client) -> None:
    """`cella keys create --e2b-format` issues a key the 2.45 SDK's format check accepts;
    cella's own form is refused by that SDK before it sends anything (the control: the
    same key form passes once E2B's check is turned off, so only the form differs)."""
    env = {**os.environ, "CELLA_URL": daemon.url, "CELLA_API_KEY": daemon.admin_key}
    made = subprocess.run(
        [
            sys.executable,
            "-m",
            "cella.cli",
            "keys",
            "create",
            "--tenant",
            "e2bform",
            "--e2b-format",
            "--json",
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    key = json.loads(made.stdout)["key"]
    own = admin.create_key("e2bform")["key"]
    script = """
        out = {}
        import e2b.api
        out["pattern"] = e2b.api._API_KEY_PATTERN.pattern
        sb = Sandbox.create(metadata={"via": "e2b-key"})
        out["run"] = sb.commands.run("echo ok").stdout
        out["listed"] = [s.metadata for s in Sandbox.list(
            query=SandboxQuery(metadata={"via": "e2b-key"})).next_items()]
        sb.kill()
        print(json.dumps(out))
        """
    got = e2b(older_python, daemon, script, key=key)
    assert got["pattern"] == r"\Ae2b_[0-9a-f]+\Z"
    assert got["run"] == "ok\n" and got["listed"] == [{"via": "e2b-key"}]
    refused = e2b(
        older_python,
        daemon,
        """
        try:
            Sandbox.list().next_items()
            print(json.dumps("sent"))
        except AuthenticationException as e:
            print(json.dumps(["refused", str(e)]))
        """,
        key=own,
    )
    assert refused[0] == "refused" and "Invalid API key format" in refused[1]
    check_off = {
        "E2B_API_URL": daemon.url,
        "E2B_SANDBOX_URL": daemon.url,
        "E2B_API_KEY": own,
        "E2B_VALIDATE_API_KEY": "false",
    }
    listed = run_script(
        older_python,
        "import json\nfrom e2b import *\nprint(json.dumps(len(Sandbox.list().next_items())))",
        check_off,
    )
    assert listed == 0  # the tenant's sandbox was killed; the key itself is good
