"""SQLite state: the only module that touches the database. It speaks in typed records."""

from cella.store.db import Store, sandbox_columns
from cella.store.observe import DeliveryRecord, MetricRecord, WebhookRecord
from cella.store.records import (
    EvalRunRecord,
    EventRecord,
    IdempotencyRecord,
    KeyRecord,
    KeyUse,
    NamedTemplateRecord,
    RegistryRecord,
    SandboxRecord,
    SecretRecord,
    SecretRef,
    SnapshotRecord,
    TemplateBuildRecord,
    VolumeRecord,
)

__all__ = [
    "DeliveryRecord",
    "EvalRunRecord",
    "EventRecord",
    "IdempotencyRecord",
    "KeyRecord",
    "KeyUse",
    "MetricRecord",
    "NamedTemplateRecord",
    "RegistryRecord",
    "SandboxRecord",
    "SecretRecord",
    "SecretRef",
    "SnapshotRecord",
    "Store",
    "TemplateBuildRecord",
    "VolumeRecord",
    "WebhookRecord",
    "sandbox_columns",
]
