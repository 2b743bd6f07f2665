"""The QEMU backend (`runtime = "qemu"`): microVMs under QEMU, KVM when a guest really boots
under it and TCG otherwise, each QEMU jailed (`jail.py`)."""

from __future__ import annotations

from cella.config import DaemonSettings
from cella.paths import Paths
from cella.runtime.contract import Driver


def open_driver(settings: DaemonSettings, paths: Paths) -> Driver:
    """A daemon's QEMU driver: its VMs outlive the daemon (a restart, or a crash,
    re-adopts them); the accelerator is settled by its `prepare()`."""
    from cella.runtime.qemu.driver import QemuDriver  # loaded once this backend is chosen
    from cella.runtime.qemu.jail import jail_ids

    return QemuDriver(
        paths,
        settings.accel,
        die_with_parent=False,
        extra_ca=settings.extra_ca_pem(),
        jail=jail_ids(settings),
    )
