"""Each QEMU in a jail of its own (`jailer.c`, compiled on first use like the guest agent):
its own uid and gid from a configured range, no capabilities, no_new_privs, new mount, IPC,
UTS and network namespaces whose root holds only that VM's files, and QEMU's seccomp
filter on top (`args.SECCOMP`).

What the jailed QEMU may touch is set up here, by the daemon, before it starts:
- its VM directory (overlay, console log) and socket directory: owned by its uid;
- what many VMs read (kernel, initramfs, template and snapshot disks): group-readable by
  the image group, which every jailed QEMU has as a supplementary group;
- the RAM file it restores from: group-writable too, because QEMU 7.2 opens a privately
  mapped memory file read-write (it never writes it; `rom=off` in QEMU >= 8.2 would let it
  open the file read-only). Snapshot files are checked against their checksums before every
  restore, so a changed RAM file is refused;
- `/dev/kvm` under KVM only (with the `kvm` group).
Everything else on the host, the data directory included, does not exist in its root.
"""

from __future__ import annotations

import contextlib
import grp
import os
import stat
import struct
import threading
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from cella import errors
from cella._proc import Progress, quiet
from cella.config import DaemonSettings
from cella.images.boot import compile_static
from cella.paths import Paths
from cella.runtime.qemu.args import VMConfig

JAIL_ROOT = Path("/run/cella/jail")  # an empty directory each jail mounts its root on
# one file per id in use, host-wide: every daemon on the host draws from the same range
ID_LOCKS = Path("/run/cella/jail-ids")
GROUP_READ = 0o440
GROUP_WRITE = 0o660


def jailer_source() -> bytes:
    return resources.files("cella.runtime.qemu").joinpath("jailer.c").read_bytes()


def ensure_jailer(paths: Paths, progress: Progress = quiet) -> Path:
    return compile_static(paths, "jailer", jailer_source(), progress)


@dataclass(frozen=True, slots=True)
class JailIds:
    """The range jailed QEMUs get their ids from: `base` is the image group, each VM gets
    `base + 1 + slot` as its uid and gid."""

    base: int
    count: int


def jail_ids(settings: DaemonSettings) -> JailIds | None:
    """The ids a daemon with these settings jails its QEMUs with (none: no jail)."""
    return JailIds(settings.jail_id_base, settings.jail_ids) if settings.jail else None


class Jail:
    """Hands out ids and wraps QEMU command lines for one driver.

    An id is held by a lock file naming the daemon that holds it (`ID_LOCKS/<uid>`, made
    exclusively), so daemons sharing the host never hand out the same one; a lock whose
    daemon is gone and whose uid runs no process is stale and cleared at start."""

    def __init__(self, jailer: Path, ids: JailIds, accel: str) -> None:
        self.jailer = jailer
        self.ids = ids
        self._kvm_gid = _group_id("kvm") if accel == "kvm" else None
        self._held: dict[str, int] = {}  # VM name -> uid
        self._lock = threading.Lock()
        JAIL_ROOT.mkdir(parents=True, exist_ok=True, mode=0o755)
        ID_LOCKS.mkdir(parents=True, exist_ok=True, mode=0o700)
        _clear_stale_locks(ids)
        self._next = ids.base + 1

    @property
    def image_gid(self) -> int:
        return self.ids.base

    def acquire(self, name: str) -> int:
        with self._lock:
            if name in self._held:
                return self._held[name]
            first, end = self.ids.base + 1, self.ids.base + 1 + self.ids.count
            for i in range(self.ids.count):  # round robin: a freed id rests a while
                uid = first + (self._next - first + i) % self.ids.count
                if _take(uid):
                    self._held[name] = uid
                    self._next = uid + 1 if uid + 1 < end else first
                    return uid
        raise errors.CapacityExceeded("no jail ids left: raise jail_ids")

    def adopt(self, name: str, uid: int) -> None:
        """A VM that outlived an earlier daemon keeps its id (and its lock is ours now)."""
        with self._lock:
            self._held[name] = uid
            _write_owner(uid)

    def release(self, name: str) -> None:
        with self._lock:
            uid = self._held.pop(name, None)
            if uid is not None:
                (ID_LOCKS / str(uid)).unlink(missing_ok=True)

    def wrap(self, config: VMConfig, argv: list[str], die_with_parent: bool) -> list[str]:
        """The jailer's command line for `argv` (QEMU's), after giving the VM's uid what it
        needs."""
        uid = self.acquire(config.name)
        rw, ro = self._files(config, uid)
        out = [str(self.jailer), "--uid", str(uid), "--gid", str(uid)]
        out += ["--group", str(self.image_gid), "--root", str(JAIL_ROOT)]
        if self._kvm_gid is not None:
            out += ["--group", str(self._kvm_gid), "--dev", "/dev/kvm"]
        out += ["--dev", "/dev/urandom", "--dev", "/dev/null"]
        for path in rw:
            out += ["--rw", str(path)]
        for path in ro:
            out += ["--ro", str(path)]
        if die_with_parent:
            out.append("--die-with-parent")
        return [*out, "--", *argv]

    def _files(self, config: VMConfig, uid: int) -> tuple[list[Path], list[Path]]:
        rw = _unique([config.console_log.parent, config.qmp_socket.parent])
        for directory in rw:
            _own(directory, uid)
        ro = [config.kernel, config.initrd]
        if config.disk is not None:
            ro += backing_chain(config.disk)
        if config.ram_file is not None and not _inside(config.ram_file, rw):
            rw.append(config.ram_file)  # a snapshot's RAM to restore from (see above)
            _share(config.ram_file, self.image_gid, GROUP_WRITE)
        ro = [p for p in _unique(ro) if not _inside(p, rw)]
        for path in ro:
            _share(path, self.image_gid, GROUP_READ)
        return rw, ro


def backing_chain(image: Path) -> list[Path]:
    """The files below a qcow2 overlay: its backing file, that file's, and so on."""
    chain = []
    current = image
    for _ in range(64):
        backing = _backing_file(current)
        if backing is None:
            break
        current = backing if backing.is_absolute() else current.parent / backing
        chain.append(current)
    return chain


def _backing_file(image: Path) -> Path | None:
    with contextlib.suppress(OSError), open(image, "rb") as f:
        header = f.read(20)
        if len(header) < 20 or header[:4] != b"QFI\xfb":
            return None
        offset, size = struct.unpack(">QI", header[8:20])
        if not offset or not size or size > 4096:
            return None
        f.seek(offset)
        return Path(f.read(size).decode())
    return None


def _own(directory: Path, uid: int) -> None:
    """The VM's directory and what is in it (not below: snapshots keep their owner)."""
    os.chown(directory, uid, uid)
    os.chmod(directory, 0o700)
    for entry in os.scandir(directory):
        if entry.is_file(follow_symlinks=False) or stat.S_ISSOCK(entry.stat().st_mode):
            os.chown(entry.path, uid, uid)


def _share(path: Path, gid: int, mode: int) -> None:
    st = path.stat()
    if st.st_gid != gid:
        os.chown(path, -1, gid)
    if stat.S_IMODE(st.st_mode) != mode:
        os.chmod(path, mode)


def _inside(path: Path, directories: list[Path]) -> bool:
    return any(path == d or d in path.parents for d in directories)


def _unique(paths: list[Path]) -> list[Path]:
    return list(dict.fromkeys(p.resolve() for p in paths))


def _group_id(name: str) -> int | None:
    with contextlib.suppress(KeyError):
        return grp.getgrnam(name).gr_gid
    return None


def _take(uid: int) -> bool:
    try:
        fd = os.open(ID_LOCKS / str(uid), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(f"{os.getpid()}\n")
    return True


def _write_owner(uid: int) -> None:
    (ID_LOCKS / str(uid)).write_text(f"{os.getpid()}\n")


def _clear_stale_locks(ids: JailIds) -> None:
    running = _uids_in_use(ids)
    for lock in ID_LOCKS.iterdir():
        with contextlib.suppress(ValueError, OSError):
            owner = int(lock.read_text().strip() or 0)
            if int(lock.name) not in running and not _alive(owner):
                lock.unlink()


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _uids_in_use(ids: JailIds) -> set[int]:
    taken = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                uid = os.stat(f"/proc/{entry}").st_uid
                if ids.base < uid <= ids.base + ids.count:
                    taken.add(uid)
    return taken


def process_uid(pid: int) -> int | None:
    with contextlib.suppress(OSError):
        return os.stat(f"/proc/{pid}").st_uid
    return None
