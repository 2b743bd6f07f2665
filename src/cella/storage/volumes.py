"""Volumes' files on the host: one directory per volume under `<data>/volumes/`, written only
by the daemon (never a path a guest or a caller chose: each path is normalised, kept under
its volume's root, and no symbolic link is followed or made). A write goes to a temporary
file beside the volumes and replaces its target whole when it is complete, so a reader sees
the old file or the new one, never half of it; the bytes a tenant may still write bound it
as it streams."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import stat as st
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from dataclasses import dataclass
from pathlib import Path

from cella import errors
from cella.models.volumes import volume_path

CHUNK = 1 << 20


@dataclass(frozen=True)
class Entry:
    path: str  # from the volume's root, `/`-led
    is_dir: bool
    size: int
    mode: int
    mtime: float
    ctime: float
    atime: float

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1] or "/"


class VolumeFiles:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.tmp = root / ".tmp"
        self.tmp.mkdir(parents=True, exist_ok=True, mode=0o700)
        for left in self.tmp.iterdir():  # writes a restart cut short
            _remove(left)

    def base(self, volume_id: str) -> Path:
        return self.root / volume_id

    def create(self, volume_id: str) -> None:
        self.base(volume_id).mkdir(mode=0o700, exist_ok=True)

    def destroy(self, volume_id: str) -> None:
        """Its files, gone (renamed away first, so nothing reads half a tree)."""
        base = self.base(volume_id)
        if base.exists():
            doomed = self.tmp / f"gone-{volume_id}-{secrets.token_hex(4)}"
            base.rename(doomed)
            shutil.rmtree(doomed, ignore_errors=True)

    def _path(self, volume_id: str, path: str) -> tuple[Path, str]:
        try:
            clean = volume_path(path)
        except ValueError as exc:
            raise errors.InvalidArgument(str(exc)) from None
        base = self.base(volume_id)
        if not base.is_dir():
            raise errors.NotFound(f"volume {volume_id} has no files")
        here = base
        for part in clean.strip("/").split("/") if clean != "/" else []:
            here = here / part
            if here.is_symlink():  # none are made; one found is never followed
                raise errors.PermissionDenied(f"{clean}: a symbolic link")
        return here, clean

    def stat(self, volume_id: str, path: str) -> Entry:
        where, clean = self._path(volume_id, path)
        try:
            return _entry(clean, where.lstat())
        except FileNotFoundError:
            raise errors.NotFound(f"{clean}: no such file or directory") from None

    def listing(self, volume_id: str, path: str, depth: int = 1) -> list[Entry]:
        """The entries under a directory, `depth` levels down (1: its own)."""
        where, clean = self._path(volume_id, path)
        if not where.is_dir():
            raise (errors.NotADirectory if where.exists() else errors.NotFound)(
                f"{clean}: not a directory" if where.exists() else f"{clean}: no such directory"
            )
        found: list[Entry] = []
        level = [(where, clean)]
        for _ in range(max(depth, 1)):
            below = []
            for folder, name in level:
                with os.scandir(folder) as items:
                    for item in sorted(items, key=lambda i: i.name):
                        if item.is_symlink():
                            continue
                        child = f"{name.rstrip('/')}/{item.name}"
                        entry = _entry(child, item.stat(follow_symlinks=False))
                        found.append(entry)
                        if entry.is_dir:
                            below.append((Path(item.path), child))
            level = below
        return found

    def size_of(self, volume_ids: Iterable[str]) -> int:
        total = 0
        for volume_id in volume_ids:
            base = self.base(volume_id)
            for folder, _, files in os.walk(base):
                for name in files:
                    try:
                        total += os.lstat(os.path.join(folder, name)).st_size
                    except OSError:
                        continue
        return total

    async def read(
        self, volume_id: str, path: str, start: int = 0, end: int | None = None
    ) -> AsyncIterator[bytes]:
        """The file's bytes from `start` to `end` (exclusive), opened now."""
        where, clean = self._path(volume_id, path)
        try:
            fd = os.open(where, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise errors.NotFound(f"{clean}: no such file") from None
        except IsADirectoryError:
            raise errors.IsADirectory(f"{clean}: a directory") from None
        if st.S_ISDIR(os.fstat(fd).st_mode):
            os.close(fd)
            raise errors.IsADirectory(f"{clean}: a directory")
        return _chunks(fd, start, end)

    async def write(
        self,
        volume_id: str,
        path: str,
        chunks: AsyncIterable[bytes],
        room: int | None,
        parents: bool = False,
    ) -> tuple[Entry, int]:
        """The file at `path` replaced with `chunks` (at most `room` bytes more than it held;
        None: unbounded); its entry and how many bytes it grew by."""
        where, clean = self._path(volume_id, path)
        if clean == "/":
            raise errors.IsADirectory("/: the volume's root")
        if where.is_dir():
            raise errors.IsADirectory(f"{clean}: a directory")
        if parents:
            self._mkdirs(volume_id, clean.rsplit("/", 1)[0] or "/")
        elif not where.parent.is_dir():
            raise errors.Conflict(f"{clean}: its directory does not exist")
        before = where.stat().st_size if where.is_file() else 0
        limit = None if room is None else room + before
        temp = self.tmp / f"w-{secrets.token_hex(8)}"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        os.fchmod(fd, 0o644)  # whatever the daemon's umask
        written = 0
        try:
            with os.fdopen(fd, "wb") as out:
                async for chunk in chunks:
                    written += len(chunk)
                    if limit is not None and written > limit:
                        raise errors.VolumeQuotaExceeded(
                            f"volume quota exceeded writing {clean}: the tenant's volumes may "
                            f"hold {room} more bytes"
                        )
                    await asyncio.to_thread(out.write, chunk)
            os.replace(temp, where)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
        return _entry(clean, where.lstat()), written - before

    def mkdir(self, volume_id: str, path: str, parents: bool = False) -> Entry:
        where, clean = self._path(volume_id, path)
        if parents:
            self._mkdirs(volume_id, clean)
        else:
            try:
                where.mkdir()
                where.chmod(0o755)
            except FileExistsError:
                raise errors.AlreadyExists(f"{clean}: exists") from None
            except FileNotFoundError:
                raise errors.Conflict(f"{clean}: its parent does not exist") from None
        return _entry(clean, where.lstat())

    def _mkdirs(self, volume_id: str, clean: str) -> None:
        here = self.base(volume_id)
        for part in clean.strip("/").split("/") if clean != "/" else []:
            here = here / part
            if here.is_symlink() or (here.exists() and not here.is_dir()):
                raise errors.NotADirectory(f"{clean}: {part} is not a directory")
            if not here.exists():
                here.mkdir()
                here.chmod(0o755)

    def remove(self, volume_id: str, path: str) -> None:
        where, clean = self._path(volume_id, path)
        if clean == "/":
            raise errors.InvalidArgument("the volume's root is removed with the volume")
        if not where.exists() and not where.is_symlink():
            raise errors.NotFound(f"{clean}: no such file or directory")
        doomed = self.tmp / f"rm-{secrets.token_hex(8)}"
        where.rename(doomed)  # gone at once for every reader; its bytes freed next
        _remove(doomed)

    def move(self, volume_id: str, src: str, dst: str, overwrite: bool = True) -> bool:
        """`src` renamed to `dst`; whether `dst` existed."""
        a, clean_a = self._path(volume_id, src)
        b, clean_b = self._path(volume_id, dst)
        if not a.exists():
            raise errors.NotFound(f"{clean_a}: no such file or directory")
        if "/" in (clean_a, clean_b) or clean_b.startswith(clean_a.rstrip("/") + "/"):
            raise errors.Conflict(f"cannot move {clean_a} to {clean_b}")
        existed = b.exists()
        if existed and not overwrite:
            raise errors.AlreadyExists(f"{clean_b}: exists")
        if not b.parent.is_dir():
            raise errors.Conflict(f"{clean_b}: its directory does not exist")
        if existed and b.is_dir() and not a.is_dir():
            raise errors.IsADirectory(f"{clean_b}: a directory")
        if existed and b.is_dir():
            self.remove(volume_id, clean_b)
        os.replace(a, b)
        return existed

    def chmod(self, volume_id: str, path: str, mode: int) -> Entry:
        where, clean = self._path(volume_id, path)
        if not where.exists():
            raise errors.NotFound(f"{clean}: no such file or directory")
        # permission bits only: the host never keeps a set-id file whose bytes a tenant chose
        os.chmod(where, mode & 0o777, follow_symlinks=False)
        return _entry(clean, where.lstat())


def _entry(path: str, info: os.stat_result) -> Entry:
    is_dir = st.S_ISDIR(info.st_mode)
    return Entry(
        path=path,
        is_dir=is_dir,
        size=0 if is_dir else info.st_size,
        mode=st.S_IMODE(info.st_mode),
        mtime=info.st_mtime,
        ctime=info.st_ctime,
        atime=info.st_atime,
    )


async def _chunks(fd: int, start: int, end: int | None) -> AsyncIterator[bytes]:
    try:
        os.lseek(fd, start, os.SEEK_SET)
        left = None if end is None else max(end - start, 0)
        while left is None or left > 0:
            want = CHUNK if left is None else min(CHUNK, left)
            chunk = await asyncio.to_thread(os.read, fd, want)
            if not chunk:
                break
            if left is not None:
                left -= len(chunk)
            yield chunk
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
