"""Checkpoints, diffs and rewind on real microVMs behind a real daemon: the diff of two
checkpoints against what the test wrote and what the guest lists, a patch that `git apply`
takes, a rewind that brings back files and a running process's memory, later checkpoints
kept, and unknown checkpoints refused."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cella import Client, Sandbox, errors
from cella.models.checkpoints import CheckpointDiff
from tests.daemon import Daemon

pytestmark = pytest.mark.vm

WORK = "/root/work"
# a counter held only in a shell's memory: each line written to the FIFO adds one, and the
# value is written out after each (the file says what the memory holds). The FIFO is made in
# the foreground: `mkfifo f && cmd &` would background both, and a bump that came first would
# make f a plain file. The counter holds the FIFO open read-write for good, so its reads never
# see an end and a line written while it is between two reads waits in the pipe, not lost.
COUNTER = (
    "mkfifo /root/inc && { nohup sh -c 'exec 3<>/root/inc; i=0; while"
    " echo $i > /root/count.tmp && mv /root/count.tmp /root/count && read x <&3;"
    " do i=$((i+1)); done' >/dev/null 2>&1 & }"
)


@pytest.fixture(scope="module")
def sb(admin: Client) -> Iterator[Sandbox]:
    sandbox = admin.create()
    try:
        yield sandbox
    finally:
        sandbox.delete()


def listing(sb: Sandbox, root: str) -> dict[str, tuple[str, int, int]]:
    """The guest's own view of a tree: relative path -> (type, size, permission bits)."""
    out = sb.exec(f"cd {root} && find . -mindepth 1 -printf '%P\\t%y\\t%s\\t%m\\n'", check=True)
    tree = {}
    for line in out.text.splitlines():
        path, kind, size, mode = line.split("\t")
        tree[path] = (kind, int(size), int(mode, 8))
    return tree


def contents(sb: Sandbox, root: str, tree: dict[str, tuple[str, int, int]]) -> dict[str, bytes]:
    return {p: sb.files.read(f"{root}/{p}") for p, (k, _, _) in tree.items() if k == "f"}


def expected_changes(
    before: dict[str, tuple[str, int, int]],
    after: dict[str, tuple[str, int, int]],
    old: dict[str, bytes],
    new: dict[str, bytes],
) -> dict[str, str]:
    """What a diff must report, from two listings and the files' bytes."""
    out = {}
    for p in after.keys() - before.keys():
        out[p] = "added"
    for p in before.keys() - after.keys():
        out[p] = "removed"
    for p in before.keys() & after.keys():
        if after[p][0] == "d":
            continue  # a directory's changes are its entries'
        if before[p] != after[p] or old.get(p) != new.get(p):
            out[p] = "modified"
    return out


def reported(diff: CheckpointDiff, root: str) -> dict[str, str]:
    return {c.path[len(root) + 1 :]: c.change for c in diff.under(root)}


def test_diff_of_two_checkpoints_matches_the_trees_at_each(sb: Sandbox) -> None:
    sb.exec(f"mkdir -p {WORK}/sub {WORK}/gone", check=True)
    sb.files.write(f"{WORK}/a.txt", "one\ntwo\nthree\n")
    sb.files.write(f"{WORK}/b.txt", "to be removed\n")
    sb.files.write(f"{WORK}/sub/c.sh", "#!/bin/sh\necho c\n")
    sb.files.write(f"{WORK}/same.txt", "unchanged\n")
    sb.files.write(f"{WORK}/gone/x.txt", "x\n")
    sb.files.write(f"{WORK}/blob.bin", bytes(range(256)) * 4)
    before = listing(sb, WORK)
    old = contents(sb, WORK, before)
    first = sb.checkpoint("first")
    assert first.name == "first" and first.sandbox_id == sb.id

    sb.files.write(f"{WORK}/a.txt", "one\nTWO\nthree\nfour\n")
    sb.exec(f"rm {WORK}/b.txt && rm -r {WORK}/gone && chmod 755 {WORK}/sub/c.sh", check=True)
    sb.exec(f"mkdir -p {WORK}/new/deep && printf 'new file\\n' > {WORK}/new/deep/d.txt", check=True)
    sb.files.write(f"{WORK}/blob.bin", bytes(range(255, -1, -1)) * 4)
    after = listing(sb, WORK)
    new = contents(sb, WORK, after)
    second = sb.checkpoint("second")

    diff = sb.diff("first", "second")
    assert diff.a == "first" and diff.b == "second" and not diff.truncated
    want = expected_changes(before, after, old, new)
    assert reported(diff, WORK) == want
    assert want == {
        "a.txt": "modified",
        "b.txt": "removed",
        "sub/c.sh": "modified",
        "gone": "removed",
        "gone/x.txt": "removed",
        "new": "added",
        "new/deep": "added",
        "new/deep/d.txt": "added",
        "blob.bin": "modified",
    }
    by_path = {c.path[len(WORK) + 1 :]: c for c in diff.under(WORK)}
    a = by_path["a.txt"]
    assert (a.old_size, a.size) == (len(old["a.txt"]), len(new["a.txt"]))
    assert a.diff is not None and "-two\n+TWO\n" in a.diff and "+four\n" in a.diff
    c = by_path["sub/c.sh"]
    assert (c.old_mode, c.mode) == (before["sub/c.sh"][2], 0o755)
    assert by_path["blob.bin"].binary and by_path["blob.bin"].diff is None
    assert by_path["new/deep"].kind == "dir" and by_path["new/deep/d.txt"].size == 9
    assert by_path["b.txt"].diff == "--- a/root/work/b.txt\n+++ /dev/null\n@@ -1 +0,0 @@\n" + (
        "-to be removed\n"
    )
    # and to now: what changed since the second checkpoint only
    sb.files.write(f"{WORK}/same.txt", "changed after\n")
    since = sb.diff(second)
    assert reported(since, WORK) == {"same.txt": "modified"}
    assert [c.name for c in sb.checkpoints()][-2:] == ["first", "second"]


def test_the_patch_applies_to_a_clean_checkout(sb: Sandbox, tmp_path: Path) -> None:
    repo = "/root/repo"
    sb.exec(
        f"mkdir -p {repo}/src && cd {repo} && git init -q && printf 'a\\nb\\nc\\n' > src/m.py"
        " && printf 'keep\\n' > README && printf 'drop me\\n' > old.txt"
        " && printf 'no newline' > tail.txt"
        " && git add -A && git -c user.email=t@t -c user.name=t commit -qm base",
        check=True,
    )
    clean = sb.checkpoint("clean")
    # the clean checkout on the host, as the guest had it at the checkpoint
    checkout = tmp_path / "checkout"
    (checkout / "src").mkdir(parents=True)
    for name in ("src/m.py", "README", "old.txt", "tail.txt"):
        (checkout / name).write_bytes(sb.files.read(f"{repo}/{name}"))
    subprocess.run(["git", "init", "-q", str(checkout)], check=True)

    sb.exec(
        f"cd {repo} && printf 'a\\nB\\nc\\nd\\n' > src/m.py && rm old.txt"
        " && printf 'brand new\\n' > src/new.py && chmod +x src/new.py"
        " && printf 'no newline, still' > tail.txt",
        check=True,
    )
    patch = sb.diff(clean).patch(repo)
    assert ".git/" not in patch and "diff --git a/src/m.py b/src/m.py" in patch
    fix = tmp_path / "fix.patch"
    fix.write_text(patch)
    subprocess.run(["git", "apply", "--check", str(fix)], cwd=checkout, check=True)
    subprocess.run(["git", "apply", str(fix)], cwd=checkout, check=True)
    for name in ("src/m.py", "src/new.py", "README", "tail.txt"):
        assert (checkout / name).read_bytes() == sb.files.read(f"{repo}/{name}"), name
    assert not (checkout / "old.txt").exists()
    assert (checkout / "src/new.py").stat().st_mode & 0o111


def bump(sb: Sandbox, times: int, expect: int) -> None:
    for _ in range(times):
        sb.exec("echo x > /root/inc", timeout=30, check=True)
    deadline = time.monotonic() + 30
    while (value := _count(sb)) != expect:
        assert time.monotonic() < deadline, f"the counter says {value}, not {expect}"
        time.sleep(0.1)


def _count(sb: Sandbox) -> int | None:
    try:
        return int(sb.files.read("/root/count"))
    except errors.NotFound:  # the counter has not written its first value yet
        return None


def test_rewind_brings_back_files_and_a_running_process_memory(sb: Sandbox) -> None:
    sb.exec(COUNTER, check=True)
    assert sb.exec("test -p /root/inc").exit_code == 0  # a FIFO, not a file a bump made
    bump(sb, 0, 0)  # running, its memory at 0
    bump(sb, 3, 3)
    sb.files.write("/root/note.txt", "at three\n")
    sb.checkpoint("three")
    bump(sb, 2, 5)
    sb.files.write("/root/note.txt", "at five\n")
    sb.files.write("/root/later.txt", "made after three\n")
    sb.checkpoint("five")

    rewound = sb.rewind("three")
    assert rewound.id == sb.id and sb.info.state.value == "running"
    assert sb.files.read("/root/note.txt") == b"at three\n"
    assert not sb.files.exists("/root/later.txt")
    assert sb.files.read("/root/count") == b"3\n"
    # the process's own memory held 3: the next bump makes 4 (not 1, not 6)
    bump(sb, 1, 4)

    # later checkpoints are kept: forward again to five
    names = [c.name for c in sb.checkpoints()]
    assert names.index("three") < names.index("five")
    sb.rewind("five")
    assert sb.files.read("/root/note.txt") == b"at five\n"
    assert sb.files.read("/root/later.txt") == b"made after three\n"
    bump(sb, 1, 6)
    kinds = [e.type for e in sb.events()]
    assert kinds.count("rewound") == 2 and "checkpoint" in kinds


def test_unknown_checkpoints_are_refused(sb: Sandbox) -> None:
    known = sb.checkpoints()[0].name  # control: a known one is found
    assert sb.diff(known, known).changes == []
    with pytest.raises(errors.NotFound):
        sb.rewind("no-such-checkpoint")
    with pytest.raises(errors.NotFound):
        sb.diff("no-such-checkpoint")
    with pytest.raises(errors.NotFound):
        sb.diff(known, "no-such-checkpoint")
    with pytest.raises(errors.AlreadyExists):
        sb.checkpoint(known)
    assert sb.exec("echo still here").stdout == b"still here\n"


def test_the_cli(sb: Sandbox, daemon: Daemon) -> None:
    def cli(*args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [sys.executable, "-m", "cella.cli", "sandbox", *args],
            env=daemon.env(None),
            capture_output=True,
            text=True,
        )
        assert (done.returncode == 0) == ok, done.stderr
        return done

    made = json.loads(cli("checkpoint", sb.id, "cli-cp", "--json").stdout)
    assert made["name"] == "cli-cp" and made["sandbox_id"] == sb.id
    assert "cli-cp" in [c["name"] for c in json.loads(cli("checkpoints", sb.id, "--json").stdout)]
    sb.files.write(f"{WORK}/cli.txt", "from the cli\n")
    listed = json.loads(cli("diff", sb.id, "cli-cp", "--path", WORK, "--json").stdout)
    assert [(c["path"], c["change"]) for c in listed["changes"]] == [(f"{WORK}/cli.txt", "added")]
    patch = cli("diff", sb.id, "cli-cp", "--path", WORK, "--patch").stdout
    assert patch.startswith("diff --git a/cli.txt b/cli.txt\nnew file mode 100644\n")
    assert f"{WORK}/cli.txt" in cli("diff", sb.id, "cli-cp").stdout
    assert json.loads(cli("rewind", sb.id, "cli-cp", "--json").stdout)["id"] == sb.id
    assert not sb.files.exists(f"{WORK}/cli.txt")
    refused = cli("rewind", sb.id, "no-such-checkpoint", ok=False)
    assert "no-such-checkpoint" in refused.stderr


def test_checkpoint_each_exec(admin: Client) -> None:
    with admin.create(checkpoint_each_exec=True) as sb:
        assert sb.info.checkpoint_each_exec
        sb.exec("echo one > /root/one.txt", check=True)
        sb.exec("echo two > /root/two.txt", check=True)
        names = [c.name for c in sb.checkpoints()]
        assert names == ["exec-1", "exec-2"]
        diff = sb.diff("exec-1", "exec-2")
        assert reported(diff, "/root") == {"two.txt": "added"}
        # file calls are not commands of the caller's: no checkpoint for them
        sb.files.write("/root/three.txt", "3\n")
        assert len(sb.checkpoints()) == 2
        mine = {c.id for c in sb.checkpoints()}
    # a deleted sandbox's checkpoints go with it
    deadline = time.monotonic() + 60
    while mine & {s.id for s in admin.snapshots()}:
        assert time.monotonic() < deadline, "the checkpoints outlived their sandbox"
        time.sleep(0.2)
