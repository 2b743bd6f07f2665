"""cella: microVM sandboxes for AI coding agents.

from cella import Sandbox
with Sandbox.create() as sb:
    print(sb.exec("uname -r").text)

The SDK is imported on first use, so `cella.policy` (stdlib only) loads without it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cella import errors
    from cella.sdk import AsyncClient, AsyncSandbox, Client, ExecResult, Sandbox

__all__ = ["AsyncClient", "AsyncSandbox", "Client", "ExecResult", "Sandbox", "errors"]
__version__ = "0.2.0"  # also in pyproject.toml; CHANGELOG.md says what each one brought


def __getattr__(name: str) -> Any:
    if name == "errors":
        return importlib.import_module("cella.errors")
    if name in __all__:
        return getattr(importlib.import_module("cella.sdk"), name)
    raise AttributeError(f"module 'cella' has no attribute {name!r}")
