"""SQLite state: the only module that touches the database. It speaks in typed records."""

from cella.store.db import Store
from cella.store.records import (
    EvalRunRecord,
    EventRecord,
    KeyRecord,
    KeyUse,
    NamedTemplateRecord,
    RegistryRecord,
    SandboxRecord,
    SecretRecord,
    SecretRef,
    SnapshotRecord,
    TemplateBuildRecord,
)

__all__ = [
    "EvalRunRecord",
    "EventRecord",
    "KeyRecord",
    "KeyUse",
    "NamedTemplateRecord",
    "RegistryRecord",
    "SandboxRecord",
    "SecretRecord",
    "SecretRef",
    "SnapshotRecord",
    "Store",
    "TemplateBuildRecord",
]
