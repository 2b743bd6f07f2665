"""Host steps inside an unpacked image's tree that never follow the image's links.

An image is untrusted: its `tmp` may be a link to the host's `/etc`. A step the host takes in
the tree (a mkdir, a chmod, a file the import adds) opens its path one component at a time
under a directory descriptor, with O_NOFOLLOW on every component: a link anywhere on the
way fails the open (ELOOP or ENOTDIR) instead of leading out of the tree.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
LINK_ERRORS = frozenset({errno.ELOOP, errno.ENOTDIR})  # what meeting a link raises


@contextlib.contextmanager
def tree(path: Path) -> Iterator[int]:
    """A descriptor of the tree's root directory (itself not a link) for the block."""
    fd = os.open(path, _DIR)
    try:
        yield fd
    finally:
        os.close(fd)


def open_beneath(root: int, rel: str, flags: int = os.O_RDONLY, mode: int = 0o644) -> int:
    """A descriptor of `rel` (relative, no `..`) under the directory `root`, no component of
    which may be a link: OSError ELOOP/ENOTDIR when one is."""
    parts = _parts(rel)
    parent = root
    try:
        for part in parts[:-1]:
            step = os.open(part, _DIR, dir_fd=parent)
            if parent != root:
                os.close(parent)
            parent = step
        return os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=parent)
    finally:
        if parent != root:
            os.close(parent)


def make_dir(root: int, rel: str, mode: int = 0o755) -> None:
    """Makes the directory `rel` under `root` unless something is there already (a link
    stays the link the image made); its parent must be a directory, reached without links."""
    *up, name = _parts(rel)
    parent = open_beneath(root, "/".join(up), _DIR) if up else root
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, mode, dir_fd=parent)
    finally:
        if parent != root:
            os.close(parent)


def _parts(rel: str) -> tuple[str, ...]:
    path = PurePosixPath(rel)
    if path.is_absolute() or not path.parts or ".." in path.parts:
        raise ValueError(f"{rel!r} is not a path inside the tree")
    return path.parts
