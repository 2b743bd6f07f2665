"""RAM layers against this process's own memory: a private file mapping stands in for a
guest's RAM (the kernel tells written pages apart the same way)."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

from cella.runtime.qemu import ramdiff

PAGE = ramdiff.PAGE
PAGES = 64


def base_file(tmp_path: Path) -> Path:
    base = tmp_path / "ram"
    with base.open("wb") as f:
        f.truncate(PAGES * PAGE)
        for page in range(0, PAGES, 3):  # some data, some holes
            f.seek(page * PAGE)
            f.write(bytes([page]) * PAGE)
    return base


def test_written_pages_are_found_saved_and_flattened(tmp_path: Path) -> None:
    base = base_file(tmp_path)
    with base.open("rb") as f:
        ram = mmap.mmap(f.fileno(), PAGES * PAGE, flags=mmap.MAP_PRIVATE)
    try:
        address = ramdiff.ram_mapping(os.getpid(), base)
        assert ramdiff.written_runs(os.getpid(), address, PAGES * PAGE) == []
        for page in (0, 1, 2, 10, 63):
            ram[page * PAGE : page * PAGE + 5] = b"wrote"
        _ = ram[20 * PAGE]  # read only: still the file's page
        runs = ramdiff.written_runs(os.getpid(), address, PAGES * PAGE)
        assert runs == [(0, 3), (10, 1), (63, 1)]
        assert ramdiff.layer_bytes(runs) == 5 * PAGE
        pieces = ramdiff.read_layer(os.getpid(), address, runs)
        assert ramdiff.write_layer(runs, pieces, tmp_path) == 5 * PAGE
        assert ramdiff.read_index(tmp_path) == runs

        flat = tmp_path / "flat"
        ramdiff.flatten(base, tmp_path, flat)
        assert flat.read_bytes() == bytes(ram)  # the base with the written pages on top
        assert base.read_bytes() != bytes(ram)  # control: the base alone is not that
    finally:
        ram.close()


def test_a_layer_loads_into_another_mapping(tmp_path: Path) -> None:
    base = base_file(tmp_path)
    with base.open("rb") as f:
        source = mmap.mmap(f.fileno(), PAGES * PAGE, flags=mmap.MAP_PRIVATE)
        target = mmap.mmap(f.fileno(), PAGES * PAGE, flags=mmap.MAP_PRIVATE)
    try:
        source[7 * PAGE : 9 * PAGE] = b"\xab" * (2 * PAGE)
        pid = os.getpid()
        # two mappings of one file: find the first, then the target by elimination
        maps = [
            int(line.split("-")[0], 16)
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
            if line.rstrip().endswith(str(base))
        ]
        assert len(maps) == 2
        runs_by_map = {a: ramdiff.written_runs(pid, a, PAGES * PAGE) for a in maps}
        [src_addr] = [a for a, runs in runs_by_map.items() if runs]
        [dst_addr] = [a for a in maps if a != src_addr]
        runs = runs_by_map[src_addr]
        ramdiff.write_layer(runs, ramdiff.read_layer(pid, src_addr, runs), tmp_path)
        assert bytes(target) != bytes(source)
        ramdiff.load_layer(pid, dst_addr, tmp_path)
        assert bytes(target) == bytes(source)
    finally:
        source.close()
        target.close()
