from __future__ import annotations

from collections.abc import Iterator

import pytest

from cella import Client
from tests.daemon import Daemon, running_daemon


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    # no warm pool here: fewer VMs idling in the background (the pool has its own tests)
    with running_daemon(tmp_path_factory.mktemp("daemon"), max_upload_mib="8", pool_size="0") as d:
        yield d


@pytest.fixture(scope="module")
def admin(daemon: Daemon) -> Iterator[Client]:
    with Client(daemon.url, daemon.admin_key) as client:
        yield client
