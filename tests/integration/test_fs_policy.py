"""What a command did to the files, and which programs may run: on real microVMs through a
real daemon. The guest's kernel reports file changes (fanotify) and asks the agent before
every execve (fanotify exec permission events); the SDK drives it all."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from cella import Client, Sandbox
from tests.daemon import SandboxFactory

pytestmark = pytest.mark.vm

LIFTED = {"default": "allow", "rules": []}


@pytest.fixture(scope="module")
def sandbox(admin: Client) -> Iterator[Sandbox]:
    with SandboxFactory() as made:
        yield made(admin)


def changes_of(sb: Sandbox, command: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The last `exec` event of `command` and the `file_changes` event under it."""
    events = sb.events(types=["exec", "file_changes"])
    run = [e for e in events if e.type == "exec" and e.data["command"] == command][-1]
    under = [e for e in events if e.type == "file_changes" and e.data["parent"] == run.id]
    return run.data, under[0].data if under else None


def test_a_command_shows_the_files_it_changed(sandbox: Sandbox) -> None:
    setup = (
        "mkdir -p /tmp/fc && cd /tmp/fc && echo old > mod.txt && echo ab > ren_src && "
        "echo d > del.txt && echo u > untouched.txt && echo k > read.txt"
    )
    assert sandbox.exec(setup).exit_code == 0
    command = (
        "cd /tmp/fc && printf hello > new.txt && printf 1234567 >> mod.txt && "
        "mv ren_src ren_dst && rm del.txt && mkdir newdir && cat read.txt untouched.txt && "
        "printf tmp > scratch && rm scratch"
    )
    assert sandbox.exec(command).exit_code == 0
    run, changes = changes_of(sandbox, command)
    assert changes is not None and changes["truncated"] == 0
    got = {c["path"]: c for c in changes["changes"]}
    assert got == {
        "/tmp/fc/new.txt": {"path": "/tmp/fc/new.txt", "change": "created", "size": 5},
        "/tmp/fc/mod.txt": {"path": "/tmp/fc/mod.txt", "change": "modified", "size": 11},
        "/tmp/fc/ren_dst": {
            "path": "/tmp/fc/ren_dst",
            "change": "renamed",
            "size": 3,
            "from": "/tmp/fc/ren_src",
        },
        "/tmp/fc/del.txt": {"path": "/tmp/fc/del.txt", "change": "deleted", "size": 0},
        "/tmp/fc/newdir": {"path": "/tmp/fc/newdir", "change": "created", "size": 0, "dir": True},
    }
    # control: files read, and one made and removed again, are not changes
    assert run["files_changed"] == 5

    # a command that only reads changes nothing; the API's own writes are not a command's
    sandbox.files.write("/tmp/fc/by-api.txt", b"api")
    assert sandbox.exec("cat /tmp/fc/new.txt /tmp/fc/by-api.txt").exit_code == 0
    run, changes = changes_of(sandbox, "cat /tmp/fc/new.txt /tmp/fc/by-api.txt")
    assert changes is None and run["files_changed"] == 0
    assert [e.data["path"] for e in sandbox.events(types=["file_write"])][-1:] == [
        "/tmp/fc/by-api.txt"
    ]


def test_exec_policy_denies_by_path_and_by_digest(sandbox: Sandbox) -> None:
    made = sandbox.exec("cp /usr/bin/curl /tmp/fetch && sha256sum /usr/bin/curl")
    digest = made.stdout.decode().split()[0]
    policy = {
        "default": "allow",
        "rules": [
            {"path_glob": "/usr/bin/curl", "action": "deny"},
            {"sha256": digest, "action": "deny"},
        ],
    }
    assert sandbox.set_exec_policy(policy).rules[1].sha256 == digest
    assert sandbox.exec_policy().model_dump(exclude_none=True) == policy

    denied = sandbox.exec("curl --version")
    assert denied.exit_code == 126 and b"Operation not permitted" in denied.stderr
    renamed = sandbox.exec("/tmp/fetch --version")  # the same bytes under another name
    assert renamed.exit_code == 126 and b"Operation not permitted" in renamed.stderr
    # written while the policy holds, and started from an interpreter: EPERM inside
    script = (
        "import os, shutil; shutil.copy('/usr/bin/curl', '/tmp/later'); "
        "os.chmod('/tmp/later', 0o755)\n"
        "try:\n os.execv('/tmp/later', ['later', '--version'])\n"
        "except PermissionError as e: print('refused', e.errno)"
    )
    inside = sandbox.exec(["python3", "-c", script])
    assert (inside.exit_code, inside.stdout) == (0, b"refused 1\n")  # control: python3 ran
    # on another file system (a tmpfs): the same
    shm = sandbox.exec("cp /usr/bin/curl /dev/shm/c && /dev/shm/c --version")
    assert shm.exit_code == 126 and b"Operation not permitted" in shm.stderr

    refusals = [e.data for e in sandbox.events(types=["exec_denied"])]
    assert {(r["path"], r["sha256"]) for r in refusals} == {
        ("/usr/bin/curl", digest),
        ("/tmp/fetch", digest),
        ("/tmp/later", digest),
        ("/dev/shm/c", digest),
    }
    assert any(r["argv"][:2] == ["python3", "-c"] for r in refusals)  # the caller

    sandbox.set_exec_policy(LIFTED)  # lifted on the running sandbox: it runs again
    lifted = sandbox.exec("curl --version && /tmp/fetch --version")
    assert lifted.exit_code == 0 and lifted.stdout.startswith(b"curl ")


def test_default_deny_lets_only_what_is_allowed_run(sandbox: Sandbox) -> None:
    policy = {"default": "deny", "rules": [{"path_glob": "/usr/bin/python3*", "action": "allow"}]}
    sandbox.set_exec_policy(policy)
    try:
        # the string's own /bin/sh is the service's, not the command's: python3 runs
        allowed = sandbox.exec("python3 -c 'print(6 * 7)'")
        assert (allowed.exit_code, allowed.stdout) == (0, b"42\n")
        refused = sandbox.exec("ls /")  # what that shell runs is held to the policy
        assert refused.exit_code == 126 and b"Operation not permitted" in refused.stderr
        nested = sandbox.exec("sh -c 'python3 -c 1'")  # a shell the command starts is too
        assert nested.exit_code == 126
        # the daemon's own work is not the tenant's command: files still move
        sandbox.files.write("/tmp/moved-a", b"x")
        sandbox.files.move("/tmp/moved-a", "/tmp/moved-b")
        assert sandbox.files.read("/tmp/moved-b") == b"x"
    finally:
        sandbox.set_exec_policy(LIFTED)
    assert sandbox.exec("ls /").exit_code == 0


def test_a_policy_set_at_create_holds_after_stop_resume_and_fork(
    admin: Client, sandbox_factory: SandboxFactory
) -> None:
    policy = {"default": "allow", "rules": [{"path_glob": "/usr/bin/curl", "action": "deny"}]}
    sb = sandbox_factory(admin, exec_policy=policy)
    assert sb.info.exec_policy is not None
    assert sb.exec("curl --version").exit_code == 126
    sb.stop()
    sb.resume()
    assert sb.exec("curl --version").exit_code == 126  # a fresh boot of its disk
    assert sb.exec("python3 -c pass").exit_code == 0
    child = sb.fork()[0]
    sandbox_factory.made.append(child)
    assert child.info.exec_policy == sb.info.exec_policy
    assert child.exec("curl --version").exit_code == 126  # a fork holds it too
    assert child.exec("python3 -c pass").exit_code == 0
