"""Boot artifacts: the guest agent (compiled from source here) and the initramfs.

The agent is the initramfs's /init: it mounts the root disk, moves into it and stays PID 1
(the kernel has every driver built in; `cella-initramfs` tells the agent where it runs).
Both artifacts are cached by content hash, so editing the agent rebuilds them on the next
start (about a second) and an unchanged tree never does. The agent rides in the
initramfs, not the template, so templates never need a rebuild for it.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from cella import errors
from cella._proc import Progress, quiet, run
from cella.images import cpio
from cella.images.kernel import Kernel
from cella.paths import Paths


@dataclass(frozen=True, slots=True)
class BootImage:
    kernel: Kernel
    initrd: Path
    agent: Path


_LOCAL_INCLUDE = re.compile(rb'^#include "([a-z_]+\.c)"$', re.MULTILINE)


def _agent_source() -> bytes:
    """agent.c with the agent's own parts (`#include "part.c"`) written in, so the one
    source compiles alone and its digest covers every part."""
    folder = resources.files("cella.guest").joinpath("agent")
    return _LOCAL_INCLUDE.sub(
        lambda m: folder.joinpath(m.group(1).decode()).read_bytes(),
        folder.joinpath("agent.c").read_bytes(),
    )


def _digest(*parts: bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(hashlib.sha256(p).digest())
    return h.hexdigest()[:16]


def ensure_agent(paths: Paths, progress: Progress = quiet) -> Path:
    """Compiles the static guest agent if this source has not been compiled before."""
    return compile_static(paths, "agent", _agent_source(), progress)


# How `compile_static` builds, in its cache key: a change that changes the bytes it makes
# compiles every program again once. 2: the source is always `NAME.c` (gcc writes the file
# name into the binary; one with the process id in it made each host's agent, and so its
# initramfs, which a memory snapshot names, a file of its own).
RECIPE = b"2"


def compile_static(paths: Paths, name: str, src: bytes, progress: Progress = quiet) -> Path:
    """A static binary of the C program `src`, cached by its content hash. The same source
    and compiler make the same bytes on every host."""
    out = paths.images / f"{name}-{_digest(src, RECIPE)}"
    if out.exists():
        return out
    if shutil.which("gcc") is None:
        raise errors.ImageMissing(f"gcc is needed to build the {name}: run `cella setup`")
    paths.ensure()
    progress(f"compiling the {name}")
    with tempfile.TemporaryDirectory(dir=paths.build_tmp, prefix=f"{name}-") as tmp:
        src_file = Path(tmp) / f"{name}.c"
        tmp_out = Path(tmp) / name
        src_file.write_bytes(src)
        run(["gcc", "-static", "-O2", "-Wall", "-o", tmp_out, src_file])
        tmp_out.rename(out)
    return out


def ensure_boot(paths: Paths, progress: Progress = quiet) -> BootImage:
    kernel = Kernel.load(paths)
    agent = ensure_agent(paths, progress)
    agent_bytes = agent.read_bytes()
    key = _digest(agent_bytes, kernel.sha256.encode())
    initrd = paths.images / f"initramfs-{key}.cpio"
    if not initrd.exists():
        progress("assembling the initramfs")
        members = [
            cpio.directory("dev"),
            cpio.directory("proc"),
            cpio.directory("sys"),
            cpio.directory("newroot"),
            cpio.file("cella-initramfs", b"", 0o644),
            cpio.file("init", agent_bytes),
        ]
        tmp = initrd.with_suffix(f".tmp{os.getpid()}")
        with tmp.open("wb") as f:
            cpio.write_newc(f, members)
        tmp.rename(initrd)
    return BootImage(kernel=kernel, initrd=initrd, agent=agent)
