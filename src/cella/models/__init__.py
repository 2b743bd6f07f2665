"""Wire types shared by the server and the SDK (pydantic; nothing heavy imported here)."""

from cella.models.exec import (
    ExecEvent,
    ExecRequest,
    ExecResult,
    OutputCollector,
    decode_data,
    encode_data,
)
from cella.models.files import ChmodRequest, FileEntry, GuestPath, MkdirRequest, guest_path
from cella.models.keys import KeyCreate, KeyCreated, KeyInfo
from cella.models.network import (
    EgressDecision,
    EgressLog,
    NetworkPolicy,
    Secret,
    SecretList,
    SecretPut,
)
from cella.models.pairs import parse_pairs
from cella.models.ports import ExposedPort, ExposeRequest
from cella.models.sandbox import (
    Event,
    EventList,
    ExecDefaults,
    ForkRequest,
    LineageNode,
    Sandbox,
    SandboxCreate,
    SandboxList,
    SandboxState,
    SandboxUsage,
    Snapshot,
    SnapshotCreate,
    SnapshotList,
    SnapshotState,
)

__all__ = [
    "ChmodRequest",
    "EgressDecision",
    "EgressLog",
    "Event",
    "EventList",
    "ExecDefaults",
    "ExecEvent",
    "ExecRequest",
    "ExecResult",
    "ExposeRequest",
    "ExposedPort",
    "FileEntry",
    "ForkRequest",
    "GuestPath",
    "KeyCreate",
    "KeyCreated",
    "KeyInfo",
    "LineageNode",
    "MkdirRequest",
    "NetworkPolicy",
    "OutputCollector",
    "Sandbox",
    "SandboxCreate",
    "SandboxList",
    "SandboxState",
    "SandboxUsage",
    "Secret",
    "SecretList",
    "SecretPut",
    "Snapshot",
    "SnapshotCreate",
    "SnapshotList",
    "SnapshotState",
    "decode_data",
    "encode_data",
    "guest_path",
    "parse_pairs",
]
