"""Client configuration (cella.config.ClientSettings through the SDK's `resolve`), the SDK's
light imports, and CLI listings that keep ids whole on a narrow terminal."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from cella import errors
from cella.models import KeyInfo, Secret, Snapshot, SnapshotState
from cella.models import Sandbox as SandboxInfo
from cella.sdk._base import resolve

HEAVY = ("fastapi", "uvicorn", "starlette", "qemu")
DAEMON_SIDE = ("cella.server", "cella.service", "cella.runtime", "cella.store")


@pytest.fixture
def data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A local daemon's data directory, found through CELLA_DATA_DIR only."""
    (tmp_path / "daemon.json").write_text(json.dumps({"url": "http://127.0.0.1:9911/"}))
    (tmp_path / "admin.key").write_text("file-key\n")
    monkeypatch.setenv("CELLA_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("CELLA_URL", raising=False)
    monkeypatch.delenv("CELLA_API_KEY", raising=False)
    return tmp_path


def test_the_sdk_loads_nothing_of_the_daemon() -> None:
    probe = (
        "import sys, cella.sdk\n"
        "from cella import Client, Sandbox\n"
        "print('\\n'.join(sorted(sys.modules)))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    )
    loaded = result.stdout.split()
    assert "cella.sdk" in loaded
    heavy = [m for m in loaded if m.split(".")[0] in HEAVY]
    daemon_side = [m for m in loaded if m.startswith(DAEMON_SIDE)]
    assert heavy == [] and daemon_side == []


def test_the_local_daemon_is_found_in_cella_data_dir(data_dir: Path) -> None:
    assert resolve(None, None) == ("http://127.0.0.1:9911", "file-key")


def test_the_environment_wins_over_the_files(
    data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CELLA_URL", "http://daemon.example:8420/")
    monkeypatch.setenv("CELLA_API_KEY", "env-key")
    assert resolve(None, None) == ("http://daemon.example:8420", "env-key")


def test_arguments_win_over_the_environment(
    data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CELLA_URL", "http://daemon.example:8420")
    monkeypatch.setenv("CELLA_API_KEY", "env-key")
    assert resolve("http://other:1/", "arg-key") == ("http://other:1", "arg-key")
    assert resolve("http://other:1", None) == ("http://other:1", "env-key")


def test_no_daemon_file_means_the_default_address(data_dir: Path) -> None:
    (data_dir / "daemon.json").unlink()
    assert resolve(None, None) == ("http://127.0.0.1:8420", "file-key")


def test_a_missing_key_says_where_it_was_looked_for(data_dir: Path) -> None:
    (data_dir / "admin.key").unlink()
    with pytest.raises(errors.Unauthenticated) as caught:
        resolve(None, None)
    message = str(caught.value)
    assert "CELLA_API_KEY" in message and str(data_dir / "admin.key") in message


def test_the_default_paths_follow_the_daemon_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cella.paths import DEFAULT_DATA_DIR, Paths

    monkeypatch.delenv("CELLA_CONFIG", raising=False)
    monkeypatch.setenv("CELLA_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("CELLA_IMAGE_DIR", str(tmp_path / "images"))
    assert Paths.default() == Paths(tmp_path / "data", tmp_path / "images")
    monkeypatch.delenv("CELLA_IMAGE_DIR")
    assert Paths.default().images == DEFAULT_DATA_DIR / "images"  # shared by all daemons


def test_the_debian_mirror_setting_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from cella.images.templates import debian_mirror

    monkeypatch.delenv("CELLA_CONFIG", raising=False)
    monkeypatch.setenv("CELLA_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("CELLA_DEBIAN_MIRROR", "http://mirror.example/debian")
    assert debian_mirror("bookworm") == "http://mirror.example/debian"


async def test_connect_attaches_and_owns_its_client(monkeypatch: pytest.MonkeyPatch) -> None:
    from cella.sdk._async import client as sdk

    known = sandbox_info(1)
    closed: list[bool] = []

    class FakeClient:
        async def get(self, sandbox_id: str) -> Any:
            if sandbox_id != known.id:
                raise errors.NotFound(sandbox_id)
            return sdk.AsyncSandbox(self, known)  # type: ignore[arg-type]

        async def close(self) -> None:
            closed.append(True)

    monkeypatch.setattr(sdk, "AsyncClient", FakeClient)
    sandbox = await sdk.AsyncSandbox.connect(known.id)
    assert sandbox.id == known.id and sandbox._owns_client
    with pytest.raises(errors.NotFound):
        await sdk.AsyncSandbox.connect("sb-missing")
    assert closed == [True]  # the failed attach closed the client it made
    given: Any = FakeClient()
    attached = await sdk.AsyncSandbox.connect(known.id, client=given)
    assert attached.client is given and not attached._owns_client


# -- listings ------------------------------------------------------------------------------

AT = datetime(2025, 3, 4, 5, 6, 7, tzinfo=UTC)


def sandbox_info(n: int, **fields: Any) -> SandboxInfo:
    values: dict[str, Any] = {
        "id": f"sb-78d6d{n:011x}",  # as the daemon makes them: sb- and 16 hex digits
        "state": "running",
        "template": "default",
        "vcpus": 2,
        "memory_mib": 1024,
        "disk_mib": None,
        "ttl_seconds": None,
        "idle_timeout_seconds": None,
        "labels": {},
        "accel": "kvm",
        "accel_reason": "/dev/kvm is usable",
        "created_at": AT,
        "updated_at": AT,
    }
    return SandboxInfo.model_validate(values | fields)


def render(renderable: Any, width: int) -> str:
    console = Console(width=width, record=True, file=io.StringIO())
    console.print(renderable)
    text = console.export_text()
    widest = max(len(line) for line in text.splitlines())
    assert widest <= width, text
    return text


@pytest.mark.parametrize("width", [80, 120])
def test_sandbox_ls_shows_whole_ids(width: int) -> None:
    from cella.cli.sandbox import listing

    infos = [
        sandbox_info(1, labels={"task": "3", "agent": "claude"}),
        sandbox_info(2, state="stopping", accel=None),
        sandbox_info(3, labels={"project": "alpha", "owner": "someone-with-a-long-name"}),
        sandbox_info(4, id="sb-ffffffffffffffff"),
    ]
    text = render(listing(infos), width)
    for info in infos:
        assert info.id in text.split(), text
    assert "running" in text and "stopping" in text  # the short columns are whole too


def test_other_listings_show_whole_ids() -> None:
    from cella.cli import keys, secret, snapshot

    snaps = [
        Snapshot(
            id=f"snap-{n:016x}",
            name=name,
            sandbox_id=f"sb-{n:016x}",
            state=SnapshotState.ready,
            template="default",
            vcpus=1,
            memory_mib=512,
            size_bytes=123 << 20,
            paused_ms=37.5,
            created_at=AT,
        )
        for n, name in enumerate(["snapshot", "after-pip-install-of-everything"])
    ]
    words = render(snapshot.listing(snaps), 80).split()
    for s in snaps:
        assert s.id in words and s.sandbox_id in words
    key = KeyInfo(id="key-0123456789ab", tenant="team", created_at=AT, admin=True)
    assert key.id in render(keys.listing([key]), 80).split()
    hosts = ["api.github.com", "github.com", "objects.githubusercontent.com"]
    token = Secret(name="GITHUB_TOKEN_FOR_CI", hosts=hosts, created_at=AT, updated_at=AT)
    assert token.name in render(secret.listing([token]), 80).split()


def test_listing_cells_are_not_markup() -> None:
    from cella.cli.sandbox import listing

    text = render(listing([sandbox_info(1, labels={"x": "[bold]y[/bold]"})]), 120)
    assert "x=[bold]y[/bold]" in text


def test_the_daemon_reads_the_toml_of_the_data_directory_it_is_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cella.config import DaemonSettings

    monkeypatch.delenv("CELLA_DATA_DIR", raising=False)
    monkeypatch.delenv("CELLA_CONFIG", raising=False)
    (tmp_path / "cella.toml").write_text("pool_size = 7\n")
    assert DaemonSettings(data_dir=tmp_path).pool_size == 7
    monkeypatch.setenv("CELLA_DATA_DIR", str(tmp_path))
    assert DaemonSettings().pool_size == 7
