"""What changed on a guest's ext4 disk between two frozen states, read on the host without
mounting either file system in the host's kernel.

Each qcow2 disk is seen as a raw file through `qemu-storage-daemon`'s FUSE export (the host
kernel sees one regular file, never the guest's file system) over a throwaway overlay, so
`e2fsck -E journal_only` can replay the guest's journal into the overlay (a running guest's
metadata may still sit in its journal) without touching the disk itself. Then the two inode
tables are compared in Python (every inode whose bytes differ, atime and checksums aside,
changed), `debugfs` names the changed inodes (`ncheck`) and dumps the contents of the text
files whose unified diff is wanted. No name the guest chose ever reaches a command line:
debugfs is given inode numbers only.
"""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import os
import re
import shutil
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from cella import errors

MAX_TEXT = 256 << 10  # a file larger than this gets no unified diff
MAX_TEXT_TOTAL = 8 << 20  # nor do files past this much text in one diff
MAX_CHANGES = 5000  # past this many changed paths the diff is cut (and says so)

S_IFMT, S_IFDIR, S_IFREG, S_IFLNK = 0o170000, 0o040000, 0o100000, 0o120000
INODE_UNINIT = 0x1
INCOMPAT_64BIT = 0x80


@dataclass(frozen=True, slots=True)
class Inode:
    mode: int
    size: int
    links: int
    dtime: int

    @property
    def live(self) -> bool:
        return self.mode != 0 and self.links > 0 and self.dtime == 0

    @property
    def kind(self) -> str:
        fmt = self.mode & S_IFMT
        return {S_IFREG: "file", S_IFDIR: "dir", S_IFLNK: "symlink"}.get(fmt, "other")


@dataclass(frozen=True, slots=True)
class Change:
    path: str
    change: str  # added, removed, modified
    kind: str
    size: int | None
    old_size: int | None
    mode: int | None
    old_mode: int | None
    diff: str | None = None
    binary: bool = False
    too_large: bool = False


@dataclass(frozen=True, slots=True)
class Geometry:
    block_size: int
    inode_size: int
    inodes_per_group: int
    tables: tuple[tuple[int, int], ...]  # (byte offset of a group's inode table, flags)


def geometry(raw: Path) -> Geometry:
    """The layout of the inode tables, from the superblock and group descriptors (bounded:
    the image is the guest's)."""
    with raw.open("rb") as f:
        f.seek(1024)
        sb = f.read(1024)
        if len(sb) < 1024 or struct.unpack_from("<H", sb, 0x38)[0] != 0xEF53:
            raise errors.InvalidArgument("the sandbox's disk holds no ext4 file system")
        blocks_lo, first_data = struct.unpack_from("<I", sb, 0x04)[0], sb[0x14]
        log_block = struct.unpack_from("<I", sb, 0x18)[0]
        blocks_per_group = struct.unpack_from("<I", sb, 0x20)[0]
        inodes_per_group = struct.unpack_from("<I", sb, 0x28)[0]
        inode_size = struct.unpack_from("<H", sb, 0x58)[0]
        incompat = struct.unpack_from("<I", sb, 0x60)[0]
        wide = bool(incompat & INCOMPAT_64BIT)
        desc_size = struct.unpack_from("<H", sb, 0xFE)[0] if wide else 32
        blocks = blocks_lo | (struct.unpack_from("<I", sb, 0x150)[0] << 32 if wide else 0)
        if log_block > 6 or not blocks_per_group or not 0 < inodes_per_group <= 1 << 20:
            raise errors.InvalidArgument("the sandbox's disk has an unreadable superblock")
        if inode_size not in (128, 256, 512, 1024) or desc_size not in (32, 64):
            raise errors.InvalidArgument("the sandbox's disk has an unreadable superblock")
        block_size = 1024 << log_block
        groups = -(-(blocks - first_data) // blocks_per_group)
        if not 0 < groups <= 1 << 17:
            raise errors.InvalidArgument("the sandbox's disk has an unreadable superblock")
        f.seek((first_data + 1) * block_size)
        table = f.read(groups * desc_size)
    tables = []
    for g in range(groups):
        d = table[g * desc_size : (g + 1) * desc_size]
        if len(d) < 32:
            break
        start = struct.unpack_from("<I", d, 0x08)[0]
        if desc_size >= 64:
            start |= struct.unpack_from("<I", d, 0x28)[0] << 32
        flags = struct.unpack_from("<H", d, 0x12)[0]
        tables.append((start * block_size, flags))
    return Geometry(block_size, inode_size, inodes_per_group, tuple(tables))


def _inode(raw: bytes) -> Inode:
    mode, _, size_lo = struct.unpack_from("<HHI", raw, 0)
    dtime = struct.unpack_from("<I", raw, 0x14)[0]
    links = struct.unpack_from("<H", raw, 0x1A)[0]
    size_hi = struct.unpack_from("<I", raw, 0x6C)[0]
    return Inode(mode, size_lo | size_hi << 32, links, dtime)


def _masked(raw: bytes) -> bytes:
    """An inode's bytes without what a read changes (atime) or follows from the rest
    (checksums)."""
    b = bytearray(raw)
    for start, end in ((0x08, 0x0C), (0x7C, 0x7E), (0x82, 0x84), (0x8C, 0x90)):
        if end <= len(b):
            b[start:end] = bytes(end - start)
    return bytes(b)


def changed_inodes(a: Path, b: Path) -> dict[int, tuple[Inode | None, Inode | None]]:
    """Every inode whose bytes differ between the two images: (before, after), None where
    it is not in use."""
    geo_a, geo_b = geometry(a), geometry(b)
    if (geo_a.inode_size, geo_a.inodes_per_group) != (geo_b.inode_size, geo_b.inodes_per_group):
        raise errors.InvalidArgument("the two disks hold different file systems")
    size, per = geo_b.inode_size, geo_b.inodes_per_group
    out: dict[int, tuple[Inode | None, Inode | None]] = {}
    with a.open("rb") as fa, b.open("rb") as fb:
        for g, ((off_a, flags_a), (off_b, flags_b)) in enumerate(
            zip(geo_a.tables, geo_b.tables, strict=False)
        ):
            if flags_a & INODE_UNINIT and flags_b & INODE_UNINIT:
                continue
            ta = b"" if flags_a & INODE_UNINIT else _read(fa, off_a, per * size)
            tb = b"" if flags_b & INODE_UNINIT else _read(fb, off_b, per * size)
            if ta == tb:
                continue
            step = 64 << 10  # compare in pieces: most of a table is the same
            for piece in range(0, per * size, step):
                pa, pb = ta[piece : piece + step], tb[piece : piece + step]
                if pa == pb:
                    continue
                for i in range(piece, min(piece + step, per * size), size):
                    ra = ta[i : i + size].ljust(size, b"\0")
                    rb = tb[i : i + size].ljust(size, b"\0")
                    if _masked(ra) == _masked(rb):
                        continue
                    ia, ib = _inode(ra), _inode(rb)
                    out[g * per + i // size + 1] = (
                        ia if ia.live else None,
                        ib if ib.live else None,
                    )
    return {n: pair for n, pair in out.items() if pair != (None, None)}


def _read(f: object, offset: int, length: int) -> bytes:
    assert hasattr(f, "seek") and hasattr(f, "read")
    f.seek(offset)
    return f.read(length)  # type: ignore[no-any-return]


async def _run(*argv: str, check: bool = True) -> bytes:
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await proc.communicate()
    if check and proc.returncode != 0:
        raise errors.CellaError(
            f"{argv[0]} failed ({proc.returncode}): {err.decode(errors='replace')[-500:]}"
        )
    return out


async def _debugfs(raw: Path, commands: list[str], work: Path) -> bytes:
    script = work / f"cmds-{os.urandom(4).hex()}"
    script.write_text("\n".join(commands) + "\n")
    try:
        return await _run("debugfs", "-f", str(script), str(raw))
    finally:
        script.unlink(missing_ok=True)


NCHECK_LINE = re.compile(rb"^(\d+)\t(/[^\n]*)$", re.M)


async def paths_of(raw: Path, inodes: list[int], work: Path) -> dict[int, list[str]]:
    """Every path of each inode (hard links give several)."""
    out: dict[int, list[str]] = {}
    if not inodes:
        return out
    commands = [
        "ncheck " + " ".join(map(str, inodes[i : i + 500])) for i in range(0, len(inodes), 500)
    ]
    text = await _debugfs(raw, commands, work)
    for m in NCHECK_LINE.finditer(text):
        path = m.group(2).decode(errors="surrogateescape")
        out.setdefault(int(m.group(1)), []).append(path)
    return out


async def dump(raw: Path, inodes: list[int], into: Path, work: Path) -> None:
    """The contents of each inode written to `into/<inode>`."""
    if inodes:
        await _debugfs(raw, [f"dump <{n}> {into / str(n)}" for n in inodes], work)


@contextlib.asynccontextmanager
async def disk_view(disk: Path, work: Path) -> AsyncIterator[Path]:
    """A raw view of a qcow2 disk with the guest's journal replayed (into a throwaway
    overlay; `disk` is only read)."""
    work.mkdir(parents=True, exist_ok=True)
    top, raw = work / "top.qcow2", work / "raw"
    await _run("qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", str(disk), str(top))
    raw.touch()
    proc = await asyncio.create_subprocess_exec(
        "qemu-storage-daemon",
        "--blockdev",
        f"driver=file,node-name=f,filename={top}",
        "--blockdev",
        "driver=qcow2,node-name=q,file=f",
        "--export",
        f"type=fuse,id=e,node-name=q,mountpoint={raw},writable=on",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        for _ in range(200):  # the export replaces the empty file within a moment
            if raw.stat().st_size > 0:
                break
            if proc.returncode is not None:
                break
            await asyncio.sleep(0.02)
        else:
            raise errors.CellaError("the disk's view did not appear")
        if raw.stat().st_size == 0:
            err = await proc.stderr.read() if proc.stderr else b""
            raise errors.CellaError(f"qemu-storage-daemon: {err.decode(errors='replace')}")
        # 0: clean, 1: the journal was replayed; anything else is a disk we cannot read
        replay = await asyncio.create_subprocess_exec(
            "e2fsck", "-E", "journal_only", "-y", str(raw),
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        _, err = await replay.communicate()
        if replay.returncode not in (0, 1):
            raise errors.CellaError(f"e2fsck: {err.decode(errors='replace')[-500:]}")
        yield raw
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        shutil.rmtree(work, ignore_errors=True)


def _text(data: bytes) -> str | None:
    if b"\0" in data:
        return None
    try:
        return data.decode()
    except UnicodeDecodeError:
        return None


def unified(old: str, new: str, path: str, *, added: bool, removed: bool) -> str:
    """A unified diff of one file's text (`git apply` reads it: a last line without its
    newline is marked as diff marks it)."""
    lines = difflib.unified_diff(
        old.splitlines(keepends=True),
        new.splitlines(keepends=True),
        "/dev/null" if added else f"a{path}",
        "/dev/null" if removed else f"b{path}",
    )
    out = []
    for line in lines:
        out.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return "".join(out)


async def diff_disks(disk_a: Path, disk_b: Path, work: Path) -> tuple[list[Change], bool]:
    """The paths added, removed and modified from `disk_a` to `disk_b` (directories only
    when added or removed), with unified diffs of text files; and whether it was cut."""
    work.mkdir(parents=True, exist_ok=True)
    try:
        async with disk_view(disk_a, work / "a") as raw_a, disk_view(disk_b, work / "b") as raw_b:
            return await _diff_views(raw_a, raw_b, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


async def _diff_views(raw_a: Path, raw_b: Path, work: Path) -> tuple[list[Change], bool]:
    inodes = await asyncio.to_thread(changed_inodes, raw_a, raw_b)
    before = [n for n, (a, _) in inodes.items() if a is not None]
    after = [n for n, (_, b) in inodes.items() if b is not None]
    paths_a, paths_b = await asyncio.gather(
        paths_of(raw_a, before, work), paths_of(raw_b, after, work)
    )
    # each path's inode before and after (a file replaced by a rename has a new one)
    old: dict[str, tuple[int, Inode]] = {}
    new: dict[str, tuple[int, Inode]] = {}
    for n, (ia, ib) in inodes.items():
        for p in paths_a.get(n, []):
            assert ia is not None
            old[p] = (n, ia)
        for p in paths_b.get(n, []):
            assert ib is not None
            new[p] = (n, ib)
    changes: list[_Pending] = []
    for p in sorted(old.keys() | new.keys()):
        (na, ia), (nb, ib) = old.get(p, (0, None)), new.get(p, (0, None))
        if ia is None:
            changes.append(_Pending(p, "added", 0, None, nb, ib))
        elif ib is None:
            changes.append(_Pending(p, "removed", na, ia, 0, None))
        elif not (ia.kind == ib.kind == "dir" and ia.mode == ib.mode):
            # (a directory whose entries changed: its entries say how)
            changes.append(_Pending(p, "modified", na, ia, nb, ib))
    truncated = len(changes) > MAX_CHANGES
    changes = changes[:MAX_CHANGES]
    # the text to diff, within the bounds
    want_a: set[int] = set()
    want_b: set[int] = set()
    budget = MAX_TEXT_TOTAL
    for c in changes:
        sizes = [i.size for i in (c.ia, c.ib) if i is not None]
        if c.kinds != {"file"} or max(sizes) > MAX_TEXT or sum(sizes) > budget:
            continue
        budget -= sum(sizes)
        if c.ia is not None:
            want_a.add(c.na)
        if c.ib is not None:
            want_b.add(c.nb)
    (work / "da").mkdir(exist_ok=True)
    (work / "db").mkdir(exist_ok=True)
    await asyncio.gather(
        dump(raw_a, sorted(want_a), work / "da", work),
        dump(raw_b, sorted(want_b), work / "db", work),
    )
    out = []
    for c in changes:
        diff, binary, too_large = None, False, False
        if c.kinds == {"file"}:
            fa, fb = work / "da" / str(c.na), work / "db" / str(c.nb)
            have_a = c.ia is None or (c.na in want_a and fa.exists())
            have_b = c.ib is None or (c.nb in want_b and fb.exists())
            if have_a and have_b:
                before_bytes = b"" if c.ia is None else fa.read_bytes()[: c.ia.size]
                after_bytes = b"" if c.ib is None else fb.read_bytes()[: c.ib.size]
                if before_bytes == after_bytes and c.ia and c.ib and c.ia.mode == c.ib.mode:
                    continue  # rewritten as it was
                old_text, new_text = _text(before_bytes), _text(after_bytes)
                if old_text is None or new_text is None:
                    binary = True
                elif old_text != new_text or c.ia is None or c.ib is None:
                    diff = unified(
                        old_text, new_text, c.path, added=c.ia is None, removed=c.ib is None
                    )
            else:
                too_large = True
        out.append(
            Change(
                path=c.path,
                change=c.change,
                kind=(c.ib or c.ia).kind,  # type: ignore[union-attr]
                size=c.ib.size if c.ib else None,
                old_size=c.ia.size if c.ia else None,
                mode=c.ib.mode & 0o7777 if c.ib else None,
                old_mode=c.ia.mode & 0o7777 if c.ia else None,
                diff=diff,
                binary=binary,
                too_large=too_large,
            )
        )
    return out, truncated


@dataclass(frozen=True, slots=True)
class _Pending:
    path: str
    change: str
    na: int
    ia: Inode | None
    nb: int
    ib: Inode | None

    @property
    def kinds(self) -> set[str]:
        return {i.kind for i in (self.ia, self.ib) if i is not None}
