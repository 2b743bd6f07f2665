"""Which kernel serves (cella's own once built, else the stock one) and the order the stock
kernel's modules load in."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cella import errors
from cella.images.kernel import Kernel, build_digest, tuned_is_current
from cella.images.stock_kernel import MODULE_DIR, ORDER, load_order, stock_dir
from cella.paths import Paths

DEPS = {
    "virtio_blk": ["virtio", "virtio_ring"],
    "virtio": ["virtio_ring"],
    "virtio_ring": [],
    "virtio_mmio": ["virtio", "virtio_ring"],
    "overlay": [],
}


def _found() -> dict[str, Path]:
    return {name: Path(f"/m/{name}.ko") for name in DEPS}


def test_modules_load_after_what_they_depend_on() -> None:
    order = load_order(("virtio_mmio", "virtio-blk", "overlay"), _found(), lambda p: DEPS[p.stem])
    assert order == ["virtio_ring", "virtio", "virtio_mmio", "virtio_blk", "overlay"]


def test_a_missing_module_or_a_loop_is_an_error() -> None:
    with pytest.raises(errors.BuildFailed, match="no module nope"):
        load_order(("nope",), _found(), lambda p: DEPS[p.stem])
    loop = {"a": ["b"], "b": ["a"]}
    found = {n: Path(f"/m/{n}.ko") for n in loop}
    with pytest.raises(errors.BuildFailed, match="loop"):
        load_order(("a",), found, lambda p: loop[p.stem])


def _stock(paths: Paths) -> None:
    folder = stock_dir(paths)
    (folder / MODULE_DIR).mkdir(parents=True)
    (folder / ORDER).write_text("virtio_ring.ko\nvirtio.ko\n")
    meta = {"version": "6.1.0-57-cloud-amd64", "source": "linux-image x", "sha256": "ab"}
    (folder / "kernel.json").write_text(json.dumps(meta))


def _tuned(paths: Paths, digest: str) -> None:
    paths.kernel.mkdir(parents=True)
    meta = {"version": "6.1-cella", "source": "s", "sha256": "cd", "build_sha256": digest}
    (paths.kernel / "kernel.json").write_text(json.dumps(meta))


def test_the_tuned_kernel_serves_once_built_else_the_stock_one(tmp_path: Path) -> None:
    paths = Paths(tmp_path)
    with pytest.raises(errors.ImageMissing):
        Kernel.load(paths)
    _stock(paths)
    stock = Kernel.load(paths)
    assert stock.kind == "stock" and stock.version.endswith("cloud-amd64")
    assert [m.name for m in stock.modules] == ["virtio_ring.ko", "virtio.ko"]
    assert stock.vmlinux == stock_dir(paths) / "vmlinuz"
    assert not tuned_is_current(paths)
    _tuned(paths, build_digest())
    tuned = Kernel.load(paths)
    assert (tuned.kind, tuned.modules) == ("tuned", ())
    assert tuned_is_current(paths)


def test_a_tuned_kernel_of_another_configuration_is_not_current(tmp_path: Path) -> None:
    paths = Paths(tmp_path)
    _tuned(paths, "another")
    assert not tuned_is_current(paths)
