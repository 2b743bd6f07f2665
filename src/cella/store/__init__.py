"""SQLite state: the only module that touches the database."""

from cella.store.db import Store

__all__ = ["Store"]
