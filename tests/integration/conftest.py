"""Each module's daemon and its admin client. A module that needs other settings overrides
`daemon_settings`, or `daemon` itself (its own directory, a wrapper); `admin` follows."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from cella import Client
from tests.daemon import Daemon, DaemonFactory


@pytest.fixture(scope="module")
def daemon_settings() -> dict[str, str]:
    # no warm pool here: fewer VMs idling in the background (the pool has its own tests)
    return {"max_upload_mib": "8", "pool_size": "0"}


@pytest.fixture(scope="module")
def daemon(daemon_settings: dict[str, str], module_daemon_factory: DaemonFactory) -> Daemon:
    # the factory after the settings (and what they name: servers, receivers), so the
    # daemon stops before those do
    return module_daemon_factory(**daemon_settings)


@pytest.fixture(scope="module")
def admin(daemon: Daemon) -> Iterator[Client]:
    with daemon.client() as client:
        yield client
