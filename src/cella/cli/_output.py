"""Shared output helpers: rich on a terminal, JSON with --json."""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console

console = Console(stderr=True)
out = Console()


def emit_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def progress_printer(json_mode: bool) -> Any:
    """Progress lines go to stderr, so --json output on stdout stays clean."""

    def show(line: str) -> None:
        console.print(
            f"[dim]{line}[/dim]" if line.startswith("  ") else f"[cyan]•[/cyan] {line}",
            highlight=False,
            markup=True,
        )

    return show
