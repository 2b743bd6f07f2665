"""Image imports with the real host tools (umoci, skopeo, mkfs.ext4, qemu-img; no VM), on
hostile images made offline: links to a host directory the test made, link chains out of an
archive, layers over the operator's limits; each with a control that imports."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import tarfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from cella import errors
from cella.images import layers, oci
from cella.images.oci import ImportLimits, _prepare, build_from_image
from cella.paths import Paths
from tests.oci_images import (
    Entry,
    add_layer,
    busybox_image,
    escaping_archive,
    hostile_nested_image,
    hostile_tmp_image,
    many_files_image,
    on_busybox,
    sparse_image,
)

LIMITS = ImportLimits(layers=4, download_mib=8, unpacked_mib=64, files=1000)


@pytest.fixture(scope="module")
def layout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    layout = tmp_path_factory.mktemp("images") / "layout"
    busybox_image(layout)  # two layers, about 40 entries, 2 MiB
    return layout


@pytest.fixture
def paths(tmp_path: Path) -> Paths:
    paths = Paths(tmp_path / "data", tmp_path / "images")
    paths.ensure()
    return paths


@pytest.fixture
def host(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """A directory and a file outside any image, standing for the host's /etc and
    /etc/hosts; checked unchanged after every test that uses them."""
    host_dir = tmp_path / "host"
    host_dir.mkdir()
    host_dir.chmod(0o755)
    host_file = tmp_path / "hosts"
    host_file.write_text("the host's own\n")
    yield host_dir, host_file
    assert host_dir.stat().st_mode & 0o7777 == 0o755
    assert list(host_dir.iterdir()) == []
    assert host_file.read_text() == "the host's own\n"


def build(paths: Paths, name: str, ref: str) -> oci.TemplateMeta:
    return build_from_image(paths, name, ref, limits=LIMITS)


# -- the preparation step ------------------------------------------------------------------


def unpacked(tmp_path: Path) -> tuple[Path, Path]:
    host = tmp_path / "etc-of-the-host"
    host.mkdir()
    host.chmod(0o755)
    rootfs = tmp_path / "rootfs"
    (rootfs / "etc").mkdir(parents=True)
    return rootfs, host


def test_preparing_a_tree_whose_tmp_is_a_host_directory(tmp_path: Path) -> None:
    rootfs, host = unpacked(tmp_path)
    (rootfs / "tmp").symlink_to(host)
    _prepare(rootfs)
    assert host.stat().st_mode & 0o7777 == 0o755  # not made world-writable
    assert list(host.iterdir()) == []
    assert (rootfs / "tmp").is_symlink()  # the image's own link, for the guest to follow
    assert (rootfs / "proc").is_dir() and (rootfs / "root").is_dir()


def test_preparing_a_tree_whose_run_is_a_dangling_link(tmp_path: Path) -> None:
    rootfs, host = unpacked(tmp_path)
    (rootfs / "run").symlink_to(host / "absent")
    _prepare(rootfs)
    assert (rootfs / "run").is_symlink() and list(host.iterdir()) == []


def test_preparing_a_tree_with_a_real_tmp(tmp_path: Path) -> None:
    """Control: the same step on a directory opens it to every user, as a /tmp is."""
    rootfs, _ = unpacked(tmp_path)
    (rootfs / "tmp").mkdir(mode=0o755)
    _prepare(rootfs)
    assert (rootfs / "tmp").stat().st_mode & 0o7777 == 0o1777
    assert (rootfs / "run").is_dir()


# -- hostile images ------------------------------------------------------------------------


def test_an_image_whose_tmp_and_hosts_link_to_the_host(
    paths: Paths, layout: Path, host: tuple[Path, Path]
) -> None:
    hostile_tmp_image(layout, *host, tag="hostile-tmp")
    made = build(paths, "hostile-tmp", f"oci:{layout}:hostile-tmp")
    assert (paths.templates / made.image).exists()  # imported; the host is as it was


def test_an_image_that_climbs_out_by_links_and_names(
    paths: Paths, layout: Path, host: tuple[Path, Path]
) -> None:
    hostile_nested_image(layout, *host, tag="hostile-nested")
    made = build(paths, "hostile-nested", f"oci:{layout}:hostile-nested")
    assert (paths.templates / made.image).exists()


def test_an_archive_whose_links_chain_out_is_refused(
    paths: Paths, tmp_path: Path, host: tuple[Path, Path]
) -> None:
    archive = tmp_path / "escaping.tar"
    escaping_archive(archive, host[0])
    with pytest.raises(errors.BuildFailed, match="not a file of an OCI layout"):
        build(paths, "escaping", f"oci-archive:{archive}")
    assert oci.read_meta(paths, "escaping") is None


def test_an_oci_archive_imports(paths: Paths, layout: Path, tmp_path: Path) -> None:
    """Control: a real OCI archive takes the same way in."""
    archive = tmp_path / "busybox.tar"
    subprocess.run(["skopeo", "copy", "--quiet", f"oci:{layout}:busybox",
                    f"oci-archive:{archive}:busybox"], check=True)  # fmt: skip
    made = build(paths, "from-archive", f"oci-archive:{archive}")
    direct = build(paths, "from-layout", f"oci:{layout}:busybox")
    assert made.digest == direct.digest and (paths.templates / made.image).exists()
    assert not list(paths.build_tmp.iterdir())  # its unpacked layout is gone


# -- a Dockerfile build's image, copied out of its builder -----------------------------------


def builder_layout(layout: Path, tmp_path: Path, tag: str = "busybox") -> Path:
    """The layout `buildah push oci:...` leaves in a builder: one image."""
    made = tmp_path / "guest-layout"
    subprocess.run(["skopeo", "copy", "--quiet", f"oci:{layout}:{tag}",
                    f"oci:{made}:cella-build"], check=True)  # fmt: skip
    return made


def copy_out(guest: Path, dest: Path, limits: ImportLimits = LIMITS) -> str:
    """`copy_layout` reading the builder's files (here: a directory standing for the guest)."""

    async def read(path: str) -> AsyncIterator[bytes]:
        async def chunks() -> AsyncIterator[bytes]:
            with open(path, "rb") as f:
                while chunk := f.read(1 << 16):
                    yield chunk

        return chunks()

    dest.mkdir()
    return asyncio.run(oci.copy_layout(read, str(guest), dest, limits))


def test_a_builders_image_comes_out_blob_by_blob(
    paths: Paths, layout: Path, tmp_path: Path
) -> None:
    guest = builder_layout(layout, tmp_path)
    image = copy_out(guest, tmp_path / "copied")
    made = build(paths, "from-builder", image)
    assert made.digest == build(paths, "direct", f"oci:{layout}:busybox").digest


def test_a_builders_blob_that_is_not_what_it_names_is_refused(
    paths: Paths, layout: Path, tmp_path: Path
) -> None:
    guest = builder_layout(layout, tmp_path)
    index = json.loads((guest / "index.json").read_text())
    manifest = guest / "blobs" / "sha256" / index["manifests"][0]["digest"].split(":")[1]
    layer = json.loads(manifest.read_text())["layers"][0]["digest"].split(":")[1]
    with open(guest / "blobs" / "sha256" / layer, "ab") as f:
        f.write(b"more")
    with pytest.raises(errors.BuildFailed, match="is not what it names"):
        copy_out(guest, tmp_path / "copied")


def test_a_builders_index_that_names_a_path_is_refused(layout: Path, tmp_path: Path) -> None:
    guest = builder_layout(layout, tmp_path)
    index = json.loads((guest / "index.json").read_text())
    index["manifests"][0]["digest"] = "sha256:../../../../etc/passwd"
    (guest / "index.json").write_text(json.dumps(index))
    with pytest.raises(errors.BuildFailed, match="not a sha256 digest"):
        copy_out(guest, tmp_path / "copied")
    (guest / "index.json").write_text('{"manifests": "no"}')
    with pytest.raises(errors.BuildFailed, match="not OCI JSON"):
        copy_out(guest, tmp_path / "copied-again")


def test_a_builders_layers_over_the_download_limit(layout: Path, tmp_path: Path) -> None:
    image = on_busybox(layout, "noisy")
    add_layer(image, [Entry("noise", data=os.urandom(12 << 20))], layout.parent)
    guest = builder_layout(layout, tmp_path, "noisy")
    with pytest.raises(errors.PayloadTooLarge, match=r"image_max_download_mib \(8 MiB\)"):
        copy_out(guest, tmp_path / "copied")


# -- limits ----------------------------------------------------------------------------------


def test_the_limits_leave_an_ordinary_image_alone(paths: Paths, layout: Path) -> None:
    made = build(paths, "busybox", f"oci:{layout}:busybox")
    assert (paths.templates / made.image).exists()


@pytest.mark.parametrize(("files", "refused"), [(1200, True), (800, False)])
def test_a_layer_of_many_files(paths: Paths, layout: Path, files: int, refused: bool) -> None:
    tag = f"files-{files}"
    many_files_image(layout, files, tag)
    if refused:
        with pytest.raises(errors.PayloadTooLarge, match=r"image_max_files \(1000\)"):
            build(paths, tag, f"oci:{layout}:{tag}")
        assert not list(paths.build_tmp.iterdir())  # refused before anything was unpacked
    else:
        build(paths, tag, f"oci:{layout}:{tag}")


@pytest.mark.parametrize(("mib", "refused"), [(10 << 10, True), (32, False)])
def test_a_sparse_file(paths: Paths, layout: Path, mib: int, refused: bool) -> None:
    """A few KiB of layer whose file is `mib` MiB once unpacked (umoci writes it whole)."""
    tag = f"sparse-{mib}"
    sparse_image(layout, mib << 20, tag)
    if refused:
        with pytest.raises(errors.PayloadTooLarge, match=r"image_max_unpacked_mib \(64 MiB\)"):
            build(paths, tag, f"oci:{layout}:{tag}")
    else:
        assert build(paths, tag, f"oci:{layout}:{tag}").disk_mib >= 32


def test_too_many_layers(paths: Paths, layout: Path) -> None:
    image = on_busybox(layout, "layers")  # two layers already
    add_layer(image, [Entry("three")], layout.parent)
    add_layer(image, [Entry("four")], layout.parent)
    build(paths, "four-layers", f"oci:{layout}:layers")  # control: at the limit
    add_layer(image, [Entry("five")], layout.parent)
    with pytest.raises(errors.PayloadTooLarge, match="5 layers; image_max_layers is 4"):
        build(paths, "five-layers", f"oci:{layout}:layers")


def test_a_layer_over_the_download_limit(paths: Paths, layout: Path) -> None:
    image = on_busybox(layout, "incompressible")
    add_layer(image, [Entry("noise", data=os.urandom(24 << 20))], layout.parent)
    with pytest.raises(errors.PayloadTooLarge, match=r"image_max_download_mib"):
        build(paths, "incompressible", f"oci:{layout}:incompressible")
    assert not list((paths.images / "oci").glob("oci-put-blob*"))  # no half-fetched blob


def test_a_header_that_asks_for_memory_ends_the_reader_not_the_caller(tmp_path: Path) -> None:
    """A pax header declaring 1.5 GiB (present, as a hole of a sparse file): a tar reader
    takes it in whole; the child reading layers is bounded to 1 GiB and its death is a
    build error."""
    header = tarfile.TarInfo("././@PaxHeader")
    header.type = tarfile.XHDTYPE
    header.size = 3 << 29
    layer = tmp_path / "layer.tar"
    with layer.open("wb") as f:
        f.write(header.tobuf(format=tarfile.USTAR_FORMAT))
        f.truncate(512 + header.size + 1024)
    with pytest.raises(errors.BuildFailed, match="MemoryError"):
        layers.measure([layer], 10, 1 << 40)
    ordinary = tmp_path / "ordinary.tar"  # control: the same reader counts a real layer
    with tarfile.open(ordinary, "w") as tar:
        tar.add(__file__, "a")
        tar.add(__file__, "b")
    assert layers.measure([ordinary], 10, 1 << 40) == layers.Unpacked(
        2, 2 * Path(__file__).stat().st_size
    )
