"""The accelerator probe: KVM only when a guest really boots under it."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from cella import errors
from cella.images.boot import ensure_boot
from cella.paths import Paths
from cella.runtime.qemu.accel import choose_accel, kvm_flavour, probe_kvm

pytestmark = pytest.mark.vm

KVM_BOOTS_HERE = Path("/dev/kvm").exists() and kvm_flavour() in ("kvm_intel", "kvm_amd")


@pytest.mark.skipif(KVM_BOOTS_HERE, reason="this host has hardware KVM")
async def test_probe_reports_tcg_with_its_reason(paths: Paths) -> None:
    boot = ensure_boot(paths)
    choice = await choose_accel(boot, "auto", cache_dir=None)
    assert choice.accel == "tcg"
    assert "TCG" in choice.reason
    if kvm_flavour() == "kvm_pvm":
        assert "kvm_pvm" in choice.reason


@pytest.mark.skipif(KVM_BOOTS_HERE, reason="this host has hardware KVM")
async def test_forced_kvm_fails_clearly_within_a_bound(paths: Paths) -> None:
    boot = ensure_boot(paths)
    start = time.monotonic()
    problem = await probe_kvm(boot, deadline=4.0)
    elapsed = time.monotonic() - start
    assert problem is not None and "KVM" in problem
    assert elapsed < 4.0 + 10  # the probe never hangs past its deadline (plus kill and reap)
    with pytest.raises(errors.AccelUnavailable, match="KVM"):
        await choose_accel(boot, "kvm", cache_dir=paths.root)


@pytest.mark.skipif(not KVM_BOOTS_HERE, reason="needs hardware KVM")
async def test_kvm_host_takes_the_kvm_path(paths: Paths) -> None:
    choice = await choose_accel(ensure_boot(paths), "auto", cache_dir=None)
    assert choice.accel == "kvm"


async def test_tcg_can_be_forced(paths: Paths) -> None:
    choice = await choose_accel(ensure_boot(paths), "tcg")
    assert choice.accel == "tcg"
