"""Python SDK: `Client`/`Sandbox` (sync) and `AsyncClient`/`AsyncSandbox` with the same shapes.

The async side is written by hand in `_async/`; `_sync/` is generated from it
(`python -m cella.sdk._generate`) and a test fails when the two drift.
"""

from cella.models import ExecResult
from cella.sdk._async.client import (
    AsyncClient,
    AsyncFiles,
    AsyncSandbox,
    AsyncSnapshot,
    AsyncVolume,
)
from cella.sdk._sync.client import Client, Files, Sandbox, Snapshot, Volume

__all__ = [
    "AsyncClient",
    "AsyncFiles",
    "AsyncSandbox",
    "AsyncSnapshot",
    "AsyncVolume",
    "Client",
    "ExecResult",
    "Files",
    "Sandbox",
    "Snapshot",
    "Volume",
]
