"""The runtime selector: which backend makes a daemon's VMs, by the `runtime` setting.

A backend is a package under `cella.runtime` whose `open_driver(settings, paths)` returns a
`contract.Driver`; whatever it probes (QEMU's accelerator, its jail) stays inside it. A new
backend (Firecracker or Cloud Hypervisor on KVM hosts) is its folder, a line in BACKENDS and
its name among the `runtime` setting's values.
"""

from __future__ import annotations

from collections.abc import Callable

from cella import errors
from cella.config import DaemonSettings
from cella.paths import Paths
from cella.runtime import qemu
from cella.runtime.contract import Driver

Opener = Callable[[DaemonSettings, Paths], Driver]
BACKENDS: dict[str, Opener] = {
    "qemu": qemu.open_driver,
}


def open_driver(settings: DaemonSettings, paths: Paths) -> Driver:
    """The driver of the backend `settings.runtime` names, for the data directory `paths`."""
    opener = BACKENDS.get(settings.runtime)
    if opener is None:
        raise errors.InvalidArgument(
            f"runtime {settings.runtime!r}: one of {', '.join(sorted(BACKENDS))}"
        )
    return opener(settings, paths)
