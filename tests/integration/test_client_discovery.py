"""A daemon on a non-default data directory is found by the SDK and the CLI from
`CELLA_DATA_DIR` alone: its address from `daemon.json`, the key from `admin.key`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from cella import Client, Sandbox
from tests.daemon import Daemon

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def daemon_settings() -> dict[str, str]:
    return {"pool_size": "0"}


@pytest.fixture
def only_data_dir(daemon: Daemon, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """This process's environment (returned for subprocesses too) names the data directory
    and nothing else: no URL, no key."""
    monkeypatch.delenv("CELLA_URL", raising=False)
    monkeypatch.delenv("CELLA_API_KEY", raising=False)
    monkeypatch.setenv("CELLA_DATA_DIR", str(daemon.data_dir))
    return dict(os.environ)


def cli_ls(env: dict[str, str]) -> list[dict[str, Any]]:
    result = subprocess.run(
        [sys.executable, "-m", "cella.cli", "sandbox", "ls", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    listed: list[dict[str, Any]] = json.loads(result.stdout)
    return listed


def test_the_daemon_wrote_where_clients_look(daemon: Daemon) -> None:
    written = json.loads((daemon.data_dir / "daemon.json").read_text())
    assert written["url"].rstrip("/") == daemon.url
    assert (daemon.data_dir / "admin.key").stat().st_mode & 0o077 == 0  # its owner only


def test_sdk_and_cli_find_the_daemon_from_the_data_dir(
    daemon: Daemon, only_data_dir: dict[str, str]
) -> None:
    with Client() as client:
        assert client.url == daemon.url
        sandbox = client.create(labels={"found": "by-data-dir"})
    listed = {s["id"]: s for s in cli_ls(only_data_dir)}
    assert sandbox.id in listed
    assert listed[sandbox.id]["labels"] == {"found": "by-data-dir"}
    # attaching without a client makes one from the environment too; leaving the block
    # deletes the sandbox and closes that client
    with Sandbox.connect(sandbox.id) as attached:
        assert attached.client.url == daemon.url
        assert attached.state == "running"
    assert sandbox.id not in {s["id"] for s in cli_ls(only_data_dir)}
