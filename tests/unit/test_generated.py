"""Generated artefacts are committed; these fail when they drift from their source."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from cella.server.app import create_app

ROOT = Path(__file__).resolve().parents[2]


def test_committed_openapi_matches_the_app() -> None:
    committed = json.loads((ROOT / "openapi.json").read_text())
    assert committed == json.loads(json.dumps(create_app().openapi())), (
        "openapi.json is stale: run scripts/openapi"
    )


def test_sync_sdk_is_generated_from_the_async_one() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "cella.sdk._generate", "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_sync_and_async_sdk_have_the_same_shape() -> None:
    from cella.sdk import (
        AsyncClient,
        AsyncFiles,
        AsyncSandbox,
        AsyncSnapshot,
        Client,
        Files,
        Sandbox,
        Snapshot,
    )

    pairs = (
        (Client, AsyncClient),
        (Sandbox, AsyncSandbox),
        (Files, AsyncFiles),
        (Snapshot, AsyncSnapshot),
    )
    for sync, async_ in pairs:
        public = {n for n in vars(sync) if not n.startswith("_")}
        assert public == {n for n in vars(async_) if not n.startswith("_")}
