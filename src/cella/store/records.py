"""Typed rows: what the store hands the service, and takes back.

Timestamps are ISO 8601 strings in UTC, as stored. JSON columns (labels, network, secrets,
event data) are decoded here, once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from cella.models.buckets import BucketMount, BucketState
from cella.models.exec_policy import ExecPolicy
from cella.models.mounts import GitMount
from cella.models.network import NetworkPolicy, SecretPut
from cella.models.sandbox import ExecDefaults, ExpiryAction, SandboxState, SnapshotState
from cella.models.volumes import VolumeMount


def epoch(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()


@dataclass(frozen=True, slots=True)
class SecretRef:
    """A sandbox's use of a secret: the guest sees `placeholder`, the proxy swaps it."""

    secret: str
    placeholder: str


@dataclass(slots=True)
class SandboxRecord:
    id: str
    tenant: str
    state: SandboxState
    template: str
    vcpus: int
    memory_mib: int
    disk_mib: int | None = None
    ttl_seconds: int | None = None
    idle_timeout_seconds: int | None = None
    ttl_action: ExpiryAction = "delete"
    idle_action: ExpiryAction = "stop"
    max_pids: int | None = None
    name: str | None = None
    delete_after_stop_seconds: int | None = None
    exec_defaults: ExecDefaults = field(default_factory=ExecDefaults)
    exec_policy: ExecPolicy | None = None  # None: every executable runs
    stopped_at: str | None = None
    stop_keeps_memory: bool = False  # a stop pauses the VM (processes and memory kept)
    checkpoint_each_exec: bool = False  # a checkpoint after every command
    # `wall`: the lifetime counts from creation; `running`: time paused or stopped does not
    # count (`held_seconds` so far, and the current hold since `held_since`)
    ttl_clock: str = "wall"
    held_seconds: float = 0.0
    held_since: str | None = None
    auto_resume: bool = False  # traffic to its ports (and E2B's envd) resumes it
    wake_ttl_seconds: int | None = None  # what a wake grants when its lifetime has run out
    # access delegation: mode, permissions, the creator's key id, the sandbox's token key
    delegation: dict[str, Any] | None = None
    labels: dict[str, str] = field(default_factory=dict)
    # who may use it (`cella.policy.access`): its creator's key and principal, visibility
    # and shares (principal -> view, exec or manage)
    creator_key: str | None = None
    creator: str | None = None
    visibility: str = "tenant"
    shares: dict[str, str] = field(default_factory=dict)
    network: NetworkPolicy = field(default_factory=NetworkPolicy)
    # who set its rewrite rules (`service.rewrites.setter_of`), None: set before it was kept
    rewrite_setter: dict[str, Any] | None = None
    secrets: dict[str, SecretRef] = field(default_factory=dict)
    mounts: list[GitMount] = field(default_factory=list)
    bucket_mounts: list[BucketMount] = field(default_factory=list)
    volume_mounts: list[VolumeMount] = field(default_factory=list)
    mount_states: dict[str, BucketState] = field(default_factory=dict)  # bucket mount id ->
    accel: str | None = None
    accel_reason: str | None = None
    error: str | None = None
    pid: int | None = None
    disk: str = "disk.qcow2"
    parent_id: str | None = None
    snapshot_id: str | None = None
    base_snapshot_id: str | None = None  # the snapshot its disk sits on (keeps it alive)
    created_from: str | None = None
    last_active_at: str | None = None
    created_at: str = ""
    updated_at: str = ""

    @property
    def access_delegation(self) -> dict[str, Any] | None:
        """The delegation as it was asked for (its key and the creator's key id left out)."""
        if not self.delegation:
            return None
        return {"mode": self.delegation["mode"], "permissions": self.delegation["permissions"]}

    @property
    def live(self) -> bool:
        """Holds (or is about to hold) a VM: counts against quotas and host capacity."""
        return self.state in LIVE_STATES

    def age_seconds(self, now: float) -> float:
        """Its age as its lifetime (`ttl_seconds`) counts it: from creation, less the time
        it was paused or stopped when its `ttl_clock` is `running`."""
        age = now - epoch(self.created_at)
        if self.ttl_clock == "running":
            age -= self.held(now)
        return max(0.0, age)

    def held(self, now: float) -> float:
        """Seconds it has spent paused or stopped (recorded since `ttl_clock` existed)."""
        current = now - epoch(self.held_since) if self.held_since else 0.0
        return self.held_seconds + max(0.0, current)

    def ends_at(self, now: float) -> float | None:
        """When its lifetime runs out, as things stand (None: it has none)."""
        if not self.ttl_seconds:
            return None
        return now + self.ttl_seconds - self.age_seconds(now)

    def idle_seconds(self, now: float) -> float:
        return now - epoch(self.last_active_at or self.created_at)


LIVE_STATES = frozenset(
    {
        SandboxState.creating,
        SandboxState.running,
        SandboxState.paused,
        SandboxState.starting,
        SandboxState.stopping,
    }
)


@dataclass(slots=True)
class SnapshotRecord:
    id: str
    tenant: str
    name: str
    sandbox_id: str
    state: SnapshotState
    template: str
    vcpus: int
    memory_mib: int
    parent_snapshot_id: str | None = None
    memory: bool = True  # False: its disk alone, booted from (nothing that ran is kept)
    size_bytes: int | None = None
    paused_ms: float | None = None
    error: str | None = None
    checkpoint: str | None = None  # a checkpoint of its sandbox, by this name
    created_at: str = ""
    updated_at: str = ""


@dataclass(slots=True)
class SecretRecord:
    tenant: str
    name: str
    value: str
    hosts: list[str]
    auth: str | None = None
    username: str | None = None
    inject: str = "anywhere"
    version: int = 1
    metadata: dict[str, str] = field(default_factory=dict)
    created_at: str = ""
    updated_at: str = ""

    @classmethod
    def put(cls, tenant: str, name: str, body: SecretPut) -> SecretRecord:
        """The record a `PUT` of the secret stores (the store keeps its version and times)."""
        return cls(
            tenant,
            name,
            body.value,
            body.hosts,
            body.auth,
            body.username,
            body.inject,
            metadata=body.metadata,
        )


@dataclass(slots=True)
class RegistryRecord:
    """A tenant's image registry: where images are pulled from, and as whom. The password
    is sealed at rest and leaves the daemon only toward the registry's own host."""

    id: str
    tenant: str
    name: str
    url: str
    username: str | None = None
    password: str | None = None
    created_at: str = ""
    updated_at: str = ""


@dataclass(slots=True)
class NamedTemplateRecord:
    """A tenant's template built from steps (E2B's `Template`): its id and name; each of
    its builds makes a cella template of the tenant's alone."""

    id: str
    tenant: str
    name: str
    created_at: str = ""
    updated_at: str = ""


@dataclass(slots=True)
class TemplateBuildRecord:
    """One build of a named template: its steps (`spec`, JSON; never a registry password),
    its state (`waiting`, `building`, `ready`, `error`), the cella template it made, the
    step that failed, and its log (JSON lines of timestamp, level, message)."""

    id: str
    template_id: str
    tenant: str
    state: str = "waiting"
    spec: str = "{}"
    image: str | None = None
    error: str | None = None
    step: str | None = None
    logs: str = "[]"
    created_at: str = ""
    updated_at: str = ""


@dataclass(slots=True)
class KeyRecord:
    id: str
    tenant: str
    hash: str
    admin: bool
    created_at: str
    revoked_at: str | None = None
    read_only: bool = False
    principal: str | None = None  # None: the key's own id
    roles: list[str] = field(default_factory=lambda: ["owner"])


@dataclass(slots=True)
class KeyUse:
    """One authenticated request: the audit log of key use."""

    key_id: str
    tenant: str
    at: str
    method: str
    path: str
    status: int
    client: str | None = None
    id: int = 0


@dataclass(slots=True)
class EventRecord:
    id: int
    sandbox_id: str
    type: str
    at: str
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class EvalRunRecord:
    """An eval run: its tasks' results are kept as the JSON they were recorded in."""

    id: str
    tenant: str
    snapshot_id: str
    tasks: int
    created_at: str
    name: str | None = None
    finished_at: str | None = None


@dataclass(slots=True)
class VolumeRecord:
    """A tenant's volume: its files live on the host, under the daemon's data directory."""

    id: str
    tenant: str
    name: str
    created_at: str = ""


@dataclass(slots=True)
class IdempotencyRecord:
    """A request made with an `Idempotency-Key`: its body's hash, and the ids of what it
    made (None while it runs)."""

    tenant: str
    route: str
    key: str
    body_hash: str
    result: list[str] | None = None
    created_at: float = 0.0
    owner: str | None = None  # the gateway that claimed it (None: this daemon)
