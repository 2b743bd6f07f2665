"""The guest kernel's configuration fragment, checked against a resolved `.config`."""

import json
from pathlib import Path

import pytest

from cella.images.kernel import config_fragment, unmet_options
from cella.paths import Paths

FRAGMENT = """# a comment
CONFIG_VIRTIO_BLK=y
CONFIG_NR_CPUS=64
CONFIG_FTRACE=n
"""


def test_every_option_taken_means_nothing_unmet() -> None:
    config = "CONFIG_VIRTIO_BLK=y\nCONFIG_NR_CPUS=64\n# CONFIG_FTRACE is not set\n"
    assert unmet_options(FRAGMENT, config) == []


def test_an_option_dropped_for_a_missing_dependency_is_named() -> None:
    # allnoconfig leaves out an option whose dependency is off: it is not in .config at all
    config = "CONFIG_NR_CPUS=64\n"
    assert unmet_options(FRAGMENT, config) == ["CONFIG_VIRTIO_BLK=y"]


def test_an_option_forced_on_by_another_is_named() -> None:
    config = "CONFIG_VIRTIO_BLK=y\nCONFIG_NR_CPUS=8\nCONFIG_FTRACE=y\n"
    assert unmet_options(FRAGMENT, config) == ["CONFIG_NR_CPUS=64", "CONFIG_FTRACE=n"]


def test_the_shipped_fragment_builds_in_what_the_guest_needs() -> None:
    fragment = config_fragment().decode()
    options = dict(
        line.split("=", 1) for line in fragment.splitlines() if line.startswith("CONFIG_")
    )
    for needed in ("PVH", "VIRTIO_MMIO", "VIRTIO_BLK", "VIRTIO_CONSOLE", "EXT4_FS", "CGROUPS"):
        assert options[f"CONFIG_{needed}"] == "y", needed
    assert "=m" not in fragment  # nothing for an initramfs to load


def test_the_build_digest_covers_the_patches(monkeypatch: pytest.MonkeyPatch) -> None:
    from cella.images import kernel

    shipped = kernel.patches()
    assert [name for name, _ in shipped] == ["lapic-timer-period.patch"]
    before = kernel.build_digest()
    changed = [(name, data + b"\n") for name, data in shipped]
    monkeypatch.setattr(kernel, "patches", lambda: changed)
    assert kernel.build_digest() != before


class _Rebuilt(Exception):
    pass


def _cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, available: str) -> Paths:
    from cella.images import kernel

    paths = Paths(tmp_path)
    paths.kernel.mkdir(parents=True)
    (paths.kernel / "vmlinux").write_bytes(b"\x7fELF")
    (paths.kernel / "kernel.json").write_text(
        json.dumps(
            {
                "version": "6.1.192-cella",
                "source": "linux-source-6.1 6.1.192-3",
                "sha256": "x",
                "build_sha256": kernel.build_digest(),
            }
        )
    )
    monkeypatch.setattr(kernel, "_resolve_source", lambda: tuple(available.split()))

    def unpack(*_: object) -> Path:
        raise _Rebuilt

    monkeypatch.setattr(kernel, "_unpack_source", unpack)
    return paths


def test_a_cached_kernel_of_the_available_source_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cella.images.kernel import ensure_kernel

    paths = _cached(tmp_path, monkeypatch, "linux-source-6.1 6.1.192-3")
    assert ensure_kernel(paths).version == "6.1.192-cella"


def test_a_newer_debian_source_builds_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cella.images.kernel import ensure_kernel

    paths = _cached(tmp_path, monkeypatch, "linux-source-6.1 6.1.193-1")
    with pytest.raises(_Rebuilt):
        ensure_kernel(paths)


def test_the_apic_period_given_at_boot_follows_the_kernels_hz() -> None:
    from cella.runtime.qemu.args import GUEST_HZ

    assert f"CONFIG_HZ_{GUEST_HZ}=y" in config_fragment().decode().splitlines()
