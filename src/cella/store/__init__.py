"""SQLite state: the only module that touches the database. It speaks in typed records."""

from cella.store.db import Store
from cella.store.observe import DeliveryRecord, MetricRecord, WebhookRecord
from cella.store.records import (
    EvalRunRecord,
    EventRecord,
    KeyRecord,
    KeyUse,
    RegistryRecord,
    SandboxRecord,
    SecretRecord,
    SecretRef,
    SnapshotRecord,
    VolumeRecord,
)

__all__ = [
    "DeliveryRecord",
    "EvalRunRecord",
    "EventRecord",
    "KeyRecord",
    "KeyUse",
    "MetricRecord",
    "RegistryRecord",
    "SandboxRecord",
    "SecretRecord",
    "SecretRef",
    "SnapshotRecord",
    "Store",
    "VolumeRecord",
    "WebhookRecord",
]
