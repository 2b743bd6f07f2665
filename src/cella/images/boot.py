"""Boot artifacts: the guest agent (compiled from source here) and the initramfs.

Both are cached by content hash, so editing the agent or the init script rebuilds them on the
next start (about a second) and an unchanged tree never does. The agent rides in the
initramfs, not the template, so templates never need a rebuild when the agent changes.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from cella import errors
from cella._proc import Progress, quiet, run
from cella.images import cpio
from cella.images.kernel import Kernel
from cella.paths import Paths

BUSYBOX = Path("/bin/busybox")
# busybox applets the init script uses
APPLETS = ("sh", "mount", "umount", "insmod", "cat", "mkdir", "cp", "sleep", "echo",
           "reboot", "switch_root")


@dataclass(frozen=True, slots=True)
class BootImage:
    kernel: Kernel
    initrd: Path
    agent: Path


def _source(name: str) -> bytes:
    if name == "agent.c":
        return resources.files("cella.guest").joinpath("agent", "agent.c").read_bytes()
    return resources.files("cella.images").joinpath(name).read_bytes()


def _digest(*parts: bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(hashlib.sha256(p).digest())
    return h.hexdigest()[:16]


def ensure_agent(paths: Paths, progress: Progress = quiet) -> Path:
    """Compiles the static guest agent if this source has not been compiled before."""
    src = _source("agent.c")
    out = paths.images / f"agent-{_digest(src)}"
    if out.exists():
        return out
    if shutil.which("gcc") is None:
        raise errors.ImageMissing("gcc is needed to build the guest agent: run `cella setup`")
    paths.ensure()
    progress("compiling the guest agent")
    src_file = paths.tmp / f"agent-{os.getpid()}.c"
    tmp_out = paths.tmp / f"agent-{os.getpid()}"
    src_file.write_bytes(src)
    try:
        run(["gcc", "-static", "-O2", "-Wall", "-o", tmp_out, src_file])
        tmp_out.rename(out)
    finally:
        src_file.unlink(missing_ok=True)
        tmp_out.unlink(missing_ok=True)
    return out


def ensure_boot(paths: Paths, progress: Progress = quiet) -> BootImage:
    kernel = Kernel.load(paths)
    agent = ensure_agent(paths, progress)
    if not BUSYBOX.exists():
        raise errors.ImageMissing(f"{BUSYBOX} is missing: run `cella setup`")
    init = _source("init.sh")
    busybox = BUSYBOX.read_bytes()
    agent_bytes = agent.read_bytes()
    modules = [(m.name, m.read_bytes()) for m in kernel.modules]
    key = _digest(init, busybox, agent_bytes, kernel.sha256.encode(),
                  *(name.encode() + data for name, data in modules))
    initrd = paths.images / f"initramfs-{key}.cpio"
    if not initrd.exists():
        progress("assembling the initramfs")
        members = [
            cpio.directory("bin"),
            cpio.file("bin/busybox", busybox),
            *(cpio.symlink(f"bin/{a}", "busybox") for a in APPLETS),
            cpio.directory("dev"),
            cpio.directory("proc"),
            cpio.directory("sys"),
            cpio.directory("newroot"),
            cpio.directory("modules"),
            cpio.file("modules/order", "".join(f"{n}\n" for n, _ in modules).encode(), 0o644),
            *(cpio.file(f"modules/{n}", data, 0o644) for n, data in modules),
            cpio.file("cella-agent", agent_bytes),
            cpio.file("init", init),
        ]
        tmp = initrd.with_suffix(f".tmp{os.getpid()}")
        with tmp.open("wb") as f:
            cpio.write_newc(f, members)
        tmp.rename(initrd)
    return BootImage(kernel=kernel, initrd=initrd, agent=agent)
