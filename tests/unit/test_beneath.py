"""Opening paths inside an untrusted tree without following its links: on real trees whose
links point at a host directory the test made."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cella.images import beneath


@pytest.fixture
def host(tmp_path: Path) -> Path:
    """A directory outside the tree, standing for the host's /etc."""
    d = tmp_path / "host"
    d.mkdir()
    d.chmod(0o755)
    (d / "hosts").write_text("the host's\n")
    return d


@pytest.fixture
def rootfs(tmp_path: Path, host: Path) -> Path:
    root = tmp_path / "rootfs"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "hostname").write_text("image\n")
    (root / "etc" / "hosts").symlink_to(host / "hosts")
    (root / "etc" / "resolv.conf").symlink_to(host / "absent")  # dangling
    (root / "host").symlink_to(host)
    (root / "inside").symlink_to("etc")  # relative, and inside: refused all the same
    return root


def test_a_plain_path_opens(rootfs: Path) -> None:
    with beneath.tree(rootfs) as root:
        fd = beneath.open_beneath(root, "etc/hostname")
        with os.fdopen(fd) as f:
            assert f.read() == "image\n"


@pytest.mark.parametrize(
    "rel", ["etc/hosts", "host", "host/hosts", "inside/hostname", "etc/resolv.conf"]
)
def test_a_link_anywhere_on_the_way_is_refused(rootfs: Path, host: Path, rel: str) -> None:
    with beneath.tree(rootfs) as root, pytest.raises(OSError) as refused:
        beneath.open_beneath(root, rel, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    assert refused.value.errno in beneath.LINK_ERRORS
    assert (host / "hosts").read_text() == "the host's\n"
    assert sorted(p.name for p in host.iterdir()) == ["hosts"]  # nothing made through it


def test_a_new_file_is_made_inside(rootfs: Path) -> None:
    with beneath.tree(rootfs) as root:
        os.close(beneath.open_beneath(root, "etc/new", os.O_WRONLY | os.O_CREAT | os.O_EXCL))
    assert (rootfs / "etc" / "new").is_file() and not (rootfs / "etc" / "new").is_symlink()


@pytest.mark.parametrize("rel", ["/etc/hosts", "../host/hosts", "etc/../../host", ""])
def test_paths_that_leave_the_tree_are_refused(rootfs: Path, rel: str) -> None:
    with beneath.tree(rootfs) as root, pytest.raises(ValueError, match="not a path inside"):
        beneath.open_beneath(root, rel)


def test_the_tree_itself_may_not_be_a_link(tmp_path: Path, host: Path) -> None:
    (tmp_path / "linked").symlink_to(host)
    with pytest.raises(OSError) as refused, beneath.tree(tmp_path / "linked"):
        pass
    assert refused.value.errno in beneath.LINK_ERRORS


def test_make_dir_makes_what_is_missing_and_leaves_links(rootfs: Path, host: Path) -> None:
    with beneath.tree(rootfs) as root:
        beneath.make_dir(root, "proc")
        beneath.make_dir(root, "host")  # a link to a directory: left as it is
        beneath.make_dir(root, "etc/resolv.conf")  # a dangling link: not made at its target
        with pytest.raises(OSError) as refused:
            beneath.make_dir(root, "host/sub")  # through a link
    assert refused.value.errno in beneath.LINK_ERRORS
    assert (rootfs / "proc").is_dir() and not (rootfs / "proc").is_symlink()
    assert (rootfs / "host").is_symlink() and (rootfs / "etc" / "resolv.conf").is_symlink()
    assert sorted(p.name for p in host.iterdir()) == ["hosts"]
