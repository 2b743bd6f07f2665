"""A template shipped between nodes by digest (the node-side room, on real files): a copy
that arrives altered or truncated is refused and deleted; an intact one is taken in once."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from cella import errors
from cella.images import oci
from cella.models import Template
from cella.paths import Paths
from cella.service.template_shipping import TemplateShipping


class Pool:
    def __init__(self, forgotten: list[str]) -> None:
        self.forgotten = forgotten

    async def forget(self, name: str) -> None:
        self.forgotten.append(name)


class Stub:
    """What the room asks of the templates room: a lock, and forgetting warm state."""

    def __init__(self, paths: Paths) -> None:
        self.paths = paths
        self.forgotten: list[str] = []
        self.pool = Pool(self.forgotten)
        self.warm = self
        self._lock = asyncio.Lock()

    def lock(self, name: str) -> asyncio.Lock:
        return self._lock

    def forget(self, name: str) -> None:
        self.forgotten.append(name)

    def get(self, name: str) -> Template:
        meta = oci.read_meta(self.paths, name)
        assert meta is not None
        return Template(name=name, kind=meta.kind, built=True, sha256=meta.sha256,
                        shipped_from=meta.shipped_from)  # fmt: skip


def record(where: TemplateShipping, name: str, base: Path) -> None:
    meta = oci.TemplateMeta(name=name, image=base.name, source="registry.test/x:1",
                            digest="sha256:" + "0" * 64, disk_mib=512)  # fmt: skip
    oci.write_meta(where.paths, meta)


def room(root: Path) -> TemplateShipping:
    paths = Paths(root / "data", root / "cache", root / "own")
    paths.ensure()
    return TemplateShipping(paths, Stub(paths))  # type: ignore[arg-type]


def copier(
    source: Path, spoil: Callable[[bytearray], bytes] = bytes
) -> Callable[[Path], Awaitable[None]]:
    async def pull(dest: Path) -> None:
        dest.write_bytes(spoil(bytearray(source.read_bytes())))

    return pull


def flipped(data: bytearray) -> bytes:
    data[len(data) // 2] ^= 0xFF
    return bytes(data)


def test_an_altered_or_truncated_copy_is_refused_and_an_intact_one_taken_in(
    tmp_path: Path,
) -> None:
    source = room(tmp_path / "a")
    base = source.paths.image_templates / "oci-0123456789abcdef-512m.qcow2"
    base.write_bytes(b"QFI\xfb" + bytes(range(256)) * 4096)
    record(source, "shipped", base)
    export = asyncio.run(source.export("shipped"))
    assert export.sha256 == oci.file_sha256(base) and export.bytes == base.stat().st_size
    assert oci.read_meta(source.paths, "shipped").sha256 == export.sha256  # type: ignore[union-attr]

    dest = room(tmp_path / "b")
    for spoil in (flipped, lambda d: bytes(d[:-1])):
        with pytest.raises(errors.TemplateCorrupt, match="refused and deleted"):
            asyncio.run(dest.take_in(export, copier(base, spoil), "n1"))
        assert list(dest.paths.image_templates.iterdir()) == []  # nothing left to boot from
        assert oci.read_meta(dest.paths, "shipped") is None

    got = asyncio.run(dest.take_in(export, copier(base), "n1"))  # the control
    assert got.sha256 == export.sha256 and got.shipped_from == "n1"
    kept = dest.paths.image_templates / base.name
    assert oci.file_sha256(kept) == export.sha256

    def never(dest_path: Path) -> Awaitable[None]:
        raise AssertionError("pulled again")

    again = asyncio.run(dest.take_in(export, never, "n1"))  # held with that digest: kept
    assert again.sha256 == export.sha256


def test_a_local_base_of_the_same_name_but_other_bytes_is_not_trusted(tmp_path: Path) -> None:
    source = room(tmp_path / "a")
    base = source.paths.image_templates / "oci-00000000000000aa-512m.qcow2"
    base.write_bytes(b"the real base")
    record(source, "t2", base)
    export = asyncio.run(source.export("t2"))
    dest = room(tmp_path / "b")
    (dest.paths.image_templates / base.name).write_bytes(b"something else")
    with pytest.raises(errors.TemplateCorrupt):
        asyncio.run(dest.take_in(export, copier(base), "n1"))
    (dest.paths.image_templates / base.name).unlink()
    shutil.copy(base, dest.paths.image_templates / base.name)  # the same bytes: no pull
    assert asyncio.run(dest.take_in(export, lambda _: None, "n1")).sha256 == export.sha256  # type: ignore[arg-type,return-value]


def test_a_base_name_that_is_a_path_is_refused(tmp_path: Path) -> None:
    source = room(tmp_path / "a")
    base = source.paths.image_templates / "oci-00000000000000bb-512m.qcow2"
    base.write_bytes(b"base")
    record(source, "t3", base)
    export = asyncio.run(source.export("t3"))
    evil = export.model_copy(update={"template": {**export.template, "image": "../../etc/x.qcow2"}})
    with pytest.raises(errors.InvalidArgument, match="plain name"):
        asyncio.run(room(tmp_path / "b").take_in(evil, copier(base), "n1"))
