"""Git mounts end to end: real microVMs, the real daemon and egress proxy, and two git
smart-HTTP servers (`git http-backend`) behind HTTPS on loopback: a public one and a private
one that wants a token. Driven by cella's SDK and by the pinned LangSmith SDK."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from langsmith.sandbox import (
    AsyncSandboxClient,
    ResourceCreationError,
    SandboxClient,
    SandboxClientError,
    context_hub_mount,
    git_mount,
    mount_config,
)

from cella import Client, Sandbox, errors
from cella.models import GitMount, GitRef
from tests.daemon import Daemon
from tests.netservers import GitHandler, Recorder, Servers, TestCA, free_loopback_block

pytestmark = pytest.mark.vm

TOKEN = "gitmount-TOKEN-7e3a91"
B64 = base64.b64encode(f"x-access-token:{TOKEN}".encode()).decode()
PUBLIC = "https://pub.test/repo.git"
PRIVATE = "https://git.test/private.git"


@dataclass
class Git:
    public_root: Path
    private_root: Path
    private_seen: Recorder
    ca: TestCA
    prefix: str

    def push(self, root: Path, repo: str, text: str, tag: str | None = None) -> str:
        """A commit on `main` of the bare repository (README = `text`); its id."""
        work = root / f"work-{repo}"
        run = _runner(root)
        if not work.exists():
            run("git", "clone", "-q", str(root / repo), str(work))
        run("git", "pull", "-q", "origin", "main", cwd=work)
        (work / "README").write_text(text)
        run("git", "commit", "-q", "-am", text.strip(), cwd=work)
        if tag:
            run("git", "tag", tag, cwd=work)
        run("git", "push", "-q", "--tags", "origin", "main", cwd=work)
        return run("git", "rev-parse", "HEAD", cwd=work).stdout.decode().strip()


def _runner(root: Path):  # type: ignore[no-untyped-def]
    env = {**os.environ, "HOME": str(root), "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t"}
    env |= {"GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}

    def run(*argv: str, cwd: Path = root) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(argv, cwd=cwd, env=env, check=True, capture_output=True)

    return run


def _bare(root: Path, repo: str) -> None:
    root.mkdir(parents=True, exist_ok=True)
    _runner(root)("git", "init", "-q", "--bare", "-b", "main", repo)


@pytest.fixture(scope="module")
def git(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Git]:
    base = tmp_path_factory.mktemp("mounts")
    prefix = free_loopback_block()
    ca = TestCA(base / "ca", ["pub.test", "git.test"])
    public_root, private_root = base / "public", base / "private"
    _bare(public_root, "repo.git")
    _bare(private_root, "private.git")
    servers = Servers()
    servers.start(GitHandler, (f"{prefix}.1", 443), ca.server_context(), root=public_root, token="")
    seen = servers.start(
        GitHandler, (f"{prefix}.2", 443), ca.server_context(), root=private_root, token=TOKEN
    )
    state = Git(public_root, private_root, seen, ca, prefix)
    # the first commit can only be pushed once the work tree exists: seed both
    for root, repo in ((public_root, "repo.git"), (private_root, "private.git")):
        work = root / f"work-{repo}"
        run = _runner(root)
        run("git", "init", "-q", "-b", "main", str(work))
        (work / "README").write_text("v1\n")
        run("git", "add", "README", cwd=work)
        run("git", "commit", "-q", "-m", "v1", cwd=work)
        run("git", "tag", "v1", cwd=work)
        run("git", "remote", "add", "origin", str(root / repo), cwd=work)
        run("git", "push", "-q", "--tags", "origin", "main", cwd=work)
    yield state
    servers.close()


@pytest.fixture(scope="module")
def daemon_settings(git: Git) -> dict[str, str]:
    prefix, ca = git.prefix, git.ca
    return {
        "pool_size": "0",
        "egress_hosts": json.dumps({"pub.test": f"{prefix}.1", "git.test": f"{prefix}.2"}),
        "egress_upstream_ca": str(ca.cert),  # the proxy, for TLS it opens (header rules)
        "extra_ca_certificates": json.dumps([str(ca.cert)]),  # guests, for TLS passed through
    }


@pytest.fixture(scope="module")
def ls(daemon: Daemon) -> Iterator[SandboxClient]:
    c = SandboxClient(api_endpoint=f"{daemon.url}/api/v2/sandboxes", api_key=daemon.admin_key)
    yield c
    c.close()


def sh(sb: Sandbox, command: str) -> str:
    r = sb.exec(command, timeout=120)
    assert r.exit_code == 0, r.stderr.decode()
    return r.stdout.decode()


def eventually(what: str, probe, timeout: float = 180) -> None:  # type: ignore[no-untyped-def]
    """Polls `probe` until it is true; `timeout` only bounds a failing test."""
    deadline = time.monotonic() + timeout
    while not probe():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.5)


def test_branch_and_tag_cloned_then_kept_fresh(admin: Client, git: Git) -> None:
    main = GitMount(
        id="main",
        path="/work/main",
        url=PUBLIC,
        ref=GitRef(type="branch", name="main"),
        refresh_interval_seconds=1,
    )
    pinned = GitMount(id="pinned", path="/work/v1", url=PUBLIC, ref=GitRef(type="tag", name="v1"))
    head = git.push(git.public_root, "repo.git", "v2\n", tag="v2")
    with admin.create(allow=["pub.test"], mounts=[main, pinned]) as sb:
        assert sh(sb, "cat /work/main/README") == "v2\n"  # the branch's head
        assert sh(sb, "cat /work/v1/README") == "v1\n"  # the tag
        assert sh(sb, "git -C /work/main rev-parse HEAD").strip() == head
        shown = admin.get(sb.id).info.mounts  # inspect shows them, as given
        assert [m.id for m in shown] == ["main", "pinned"]
        assert shown[0].ref == GitRef(type="branch", name="main")
        # a push upstream reaches the branch's mount by its refresh; the tag stays
        newer = git.push(git.public_root, "repo.git", "v3\n")
        eventually("the push refreshed in", lambda: sh(sb, "cat /work/main/README") == "v3\n")
        assert sh(sb, "cat /work/v1/README") == "v1\n"
        updated = [e.data for e in sb.events(types=["mount_updated"])]
        assert {"mount": "main", "commit": newer} in updated
        # an explicit refresh: the tag's mount follows a moved tag (no interval of its own)
        [v1] = sb.refresh_mounts("pinned")
        assert v1.id == "pinned" and sh(sb, "cat /work/v1/README") == "v1\n"
        with pytest.raises(errors.NotFound):
            sb.refresh_mounts("nope")
        # a fork keeps the mounts and refreshes them on its own
        [branch] = sb.fork()
        try:
            assert [m.id for m in branch.info.mounts] == ["main", "pinned"]
            forked = git.push(git.public_root, "repo.git", "v3.1\n")
            eventually(
                "the fork refreshed", lambda: sh(branch, "cat /work/main/README") == "v3.1\n"
            )
            assert sh(branch, "git -C /work/main rev-parse HEAD").strip() == forked
        finally:
            branch.delete()
        # stopped: no refresh wakes it; resumed: its mounts refresh again
        sb.stop()
        newest = git.push(git.public_root, "repo.git", "v4\n")
        time.sleep(2)  # two refresh intervals: a running loop would fail (or wake it)
        assert admin.get(sb.id).info.state == "stopped"
        assert not sb.events(types=["mount_refresh_failed"])  # the loop ended with the VM
        sb.resume()
        eventually("refreshed after resume", lambda: sh(sb, "cat /work/main/README") == "v4\n")
        assert sh(sb, "git -C /work/main rev-parse HEAD").strip() == newest


def test_refreshes_do_not_keep_a_sandbox_from_going_idle(admin: Client) -> None:
    mount = GitMount(id="m", path="/work/m", url=PUBLIC, refresh_interval_seconds=1)
    with admin.create(allow=["pub.test"], mounts=[mount], idle_timeout_seconds=3) as sb:
        eventually("idle stop", lambda: admin.get(sb.id).info.state == "stopped")
        # the refreshes ran meanwhile (git fetch in the guest), and did not count
        assert any("fetch" in e.data["command"] for e in sb.events(types=["exec"]))


def test_a_clone_that_fails_fails_the_create_naming_the_mount(admin: Client) -> None:
    bad = GitMount(id="nosuch", path="/work/x", url=PUBLIC, ref=GitRef(type="branch", name="nope"))
    before = {s.id for s in admin.list()}
    with pytest.raises(errors.InvalidArgument) as caught:
        admin.create(allow=["pub.test"], name="failing-mount", mounts=[bad])
    assert "mount 'nosuch'" in str(caught.value) and "nope" in str(caught.value)
    [failed] = [s for s in admin.list() if s.id not in before]
    assert failed.info.state == "error" and "mount 'nosuch'" in (failed.info.error or "")
    # the same mount without its host in the egress rules: refused by the proxy
    denied = GitMount(id="denied", path="/work/x", url=PUBLIC)
    with pytest.raises(errors.InvalidArgument, match="mount 'denied'"):
        admin.create(mounts=[denied])
    # control: allowed, and a ref that exists, the same create succeeds
    good = bad.model_copy(update={"ref": GitRef(type="branch", name="main")})
    with admin.create(allow=["pub.test"], mounts=[good]) as sb:
        assert sh(sb, "git -C /work/x rev-parse --abbrev-ref HEAD").strip() == "main"


def test_bad_mounts_are_refused_before_anything_starts(admin: Client) -> None:
    bodies = [
        {"id": "a", "path": "relative", "url": PUBLIC},
        {"id": "a", "path": "/w", "url": "https://x:y@pub.test/repo.git"},
        {"id": "a", "path": "/w", "url": "ssh://pub.test/repo.git"},
        {
            "id": "a",
            "path": "/w",
            "url": PUBLIC,
            "ref": {"type": "branch", "name": "--upload-pack=x"},
        },
    ]
    two = [{"id": "a", "path": "/w", "url": PUBLIC}, {"id": "b", "path": "/w/in", "url": PUBLIC}]
    before = len(admin.list())
    for mounts in [*([body] for body in bodies), two]:
        with pytest.raises(errors.InvalidArgument):
            admin.request("POST", "/v1/sandboxes", json={"mounts": mounts})
    assert len(admin.list()) == before  # nothing was started


def test_langsmith_private_repo_with_a_header_rule_the_guest_never_sees(
    ls: SandboxClient, admin: Client, git: Git
) -> None:
    admin.put_secret("GITAUTH", B64, ["git.test"])  # a workspace secret
    mounts = mount_config(
        mounts=[
            git_mount(
                id="private",
                mount_path="/work/private",
                remote_url=PRIVATE,
                ref={"type": "branch", "name": "main"},
                refresh_interval_seconds=1,
            )
        ]
    )
    allow = {"access_control": {"allow_list": ["git.test"]}}
    rule = {
        "name": "git",
        "match_hosts": ["git.test"],
        "headers": [
            {"name": "Authorization", "type": "workspace_secret", "value": "Basic {GITAUTH}"}
        ],
    }
    # without the header rule the server wants credentials and the create fails
    with pytest.raises(ResourceCreationError, match="mount 'private'") as caught:
        ls.create_sandbox(name="no-rule", mount_config=mounts, proxy_config=allow)
    assert caught.value.error_type == "SandboxConfig"  # the SDK's creation failure
    assert "could not read Username" in str(caught.value)  # git was asked to log in
    with ls.sandbox(
        name="with-rule", mount_config=mounts, proxy_config={**allow, "rules": [rule]}
    ) as box:
        assert box.run("cat /work/private/README").stdout == "v1\n"
        git.push(git.private_root, "private.git", "private v2\n")
        eventually(
            "the private push refreshed in",
            lambda: box.run("cat /work/private/README").stdout == "private v2\n",
        )
        # every file the clone could have written to, read out and searched here (a search
        # in the guest would hand it the credential in its command line)
        where = box.run(
            "env; cat /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n'; "
            "git -C /work/private config --list --show-origin; "
            "find /work /root /tmp /etc/gitconfig -type f -size -4M -print0 2>/dev/null"
            " | xargs -0 cat 2>/dev/null; true",
            timeout=120,
        ).stdout
        assert '[remote "origin"]' in where  # the control: .git/config was read
        assert TOKEN not in where and B64 not in where and "x-access-token" not in where
        trace = json.dumps([e.data for e in admin.get(box.id).events()])
        assert TOKEN not in trace and B64 not in trace
    assert git.private_seen.requests
    assert {r["authorization"] for r in git.private_seen.requests} <= {"", f"Basic {B64}"}
    assert any(r["authorization"] == f"Basic {B64}" for r in git.private_seen.requests)


def test_langsmith_async_clone_at_a_tag(daemon: Daemon) -> None:
    async def main() -> str:
        async with AsyncSandboxClient(
            api_endpoint=f"{daemon.url}/api/v2/sandboxes", api_key=daemon.admin_key
        ) as client:
            config = mount_config(
                mounts=[
                    git_mount(
                        id="tagged",
                        mount_path="/srv/tagged",
                        remote_url=PUBLIC,
                        ref={"type": "tag", "name": "v1"},
                    )
                ]
            )
            allow = {"access_control": {"allow_list": ["pub.test"]}}
            async with await client.sandbox(mount_config=config, proxy_config=allow) as box:
                return (await box.run("cat /srv/tagged/README")).stdout

    assert asyncio.run(main()) == "v1\n"


def test_langsmith_mounts_cella_cannot_serve_are_refused_by_name(ls: SandboxClient) -> None:
    refused = {
        "Context Hub": mount_config(
            mounts=[context_hub_mount(id="hub", mount_path="/hub", repo="me/ctx")]
        ),
    }  # (bucket mounts: tests/integration/test_buckets.py)
    for words, config in refused.items():
        with pytest.raises(SandboxClientError) as caught:
            ls.create_sandbox(mount_config=config)
        assert "not supported by cella" in str(caught.value) and words in str(caught.value)
    # control: a git mount, in the same way, is served
    allow = {"access_control": {"allow_list": ["pub.test"]}}
    config = mount_config(mounts=[git_mount(id="g", mount_path="/g", remote_url=PUBLIC)])
    with ls.sandbox(mount_config=config, proxy_config=allow) as box:
        assert box.run("cat /g/README").stdout.startswith("v")
