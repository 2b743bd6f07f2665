"""A first start without compiling a kernel: a daemon whose image directory holds Debian's
stock cloud kernel (and no kernel of cella's own) boots sandboxes on it, says so in its
health, and moves new sandboxes to cella's own kernel when that one appears (as the
background build leaves it), while a sandbox made before keeps its kernel, and so do forks of it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cella import Sandbox
from cella.images.kernel_builds import PID
from cella.images.stock_kernel import ensure_stock_kernel, stock_dir
from cella.images.templates import builtin_templates, template_image
from cella.paths import Paths
from tests.daemon import DaemonFactory

pytestmark = [pytest.mark.vm, pytest.mark.timeout(900)]
SHARED = Paths.default()  # the host's image cache: its tuned kernel and default template


def _link_tree(src: Path, dest: Path) -> None:
    """`src` under `dest` as hard links where the file system allows (copies otherwise)."""
    shutil.copytree(src, dest, copy_function=_link)


def _link(src: str, dest: str) -> None:
    try:
        os.link(src, dest)
    except OSError:
        shutil.copy2(src, dest)


def _uname(sandbox: Sandbox) -> str:
    result = sandbox.exec(["uname", "-r"])
    assert result.exit_code == 0, result.stderr
    return result.stdout.decode().strip()


def test_sandboxes_start_on_the_stock_kernel_and_move_to_the_tuned_one(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    ensure_stock_kernel(SHARED)  # a download of seconds, kept by package version
    images = tmp_path / "images"
    (images / "templates").mkdir(parents=True)
    base = template_image(SHARED, builtin_templates()["default"])
    for f in (base, base.with_suffix(".json")):
        _link(str(f), str(images / "templates" / f.name))
    _link_tree(stock_dir(SHARED), stock_dir(Paths(tmp_path, images)))
    (images / "egress").symlink_to(SHARED.images / "egress")  # the proxy's own virtualenv
    # a build under way, as `cella setup` leaves one (a process named as the build is)
    builder = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)", "--kernel-only"]
    )
    (images / PID).write_text(str(builder.pid))
    try:
        daemon = daemon_factory("stock", image_dir=str(images), pool_size="0", timeout=300)
        client = daemon.client()
        health = client.health()["kernel"]
        assert (health["kind"], health["upgrade"]) == ("stock", "building"), health
        first = client.create(template="default")
        stock_release = _uname(first)
        assert stock_release == health["version"]
        assert stock_release.endswith("-cloud-amd64")
        first.files.write("/root/note.txt", b"made on the stock kernel")
        snap = first.snapshot()
    finally:
        builder.kill()
        builder.wait()
    # the build ends: cella's own kernel is where it leaves it, swapped in whole
    tuned = Paths(tmp_path, images).kernel
    _link_tree(SHARED.kernel, tuned.with_name("kernel.new"))
    shutil.rmtree(tuned)
    tuned.with_name("kernel.new").rename(tuned)
    with client:
        deadline = time.monotonic() + 60
        while (health := client.health()["kernel"])["kind"] != "tuned":
            assert time.monotonic() < deadline, health
            time.sleep(0.5)
        assert health["upgrade"] is None
        tuned_release = _uname(client.create(template="default"))
        assert tuned_release == health["version"] != stock_release
        # what was made before keeps its kernel: the running sandbox and forks of its snapshot
        assert _uname(client.get(first.id)) == stock_release
        [fork] = snap.fork()
        assert _uname(fork) == stock_release
        assert fork.files.read("/root/note.txt") == b"made on the stock kernel"
