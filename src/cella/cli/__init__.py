"""The `cella` command line."""

from cella.cli.app import app, main

__all__ = ["app", "main"]
