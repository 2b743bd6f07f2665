"""Sandboxes and their lifecycle events."""

from __future__ import annotations

import re
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from cella.models.buckets import BucketMount, BucketState, check_bucket_auth
from cella.models.exec_policy import ExecPolicy
from cella.models.mounts import MAX_MOUNTS, GitMount, check_mounts
from cella.models.network import ENV_NAME, SECRET_NAME, NetworkPolicy
from cella.models.volumes import MAX_VOLUME_MOUNTS, VolumeMount
from cella.policy.access import Visibility


class SandboxState(StrEnum):
    creating = "creating"
    running = "running"
    paused = "paused"
    stopping = "stopping"
    stopped = "stopped"
    starting = "starting"
    deleting = "deleting"
    deleted = "deleted"
    error = "error"
    lost = "lost"  # its fleet node died or left: only the gateway reports this
    # brought back on another fleet node from its replica, stopped until it is resumed:
    # only the gateway reports this
    recovered = "recovered"


ExpiryAction = Literal["stop", "pause", "delete"]
TtlClock = Literal["wall", "running"]
MAX_FORKS = 100  # branches of one fork call
RestoreMemory = Literal["if_present", "always", "never"]
DelegatedPermission = Literal["sandboxes:read", "sandboxes:write"]
LABEL_KEY = r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,62}$"
NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
MAX_LIFETIME_SECONDS = 30 * 86400  # a sandbox's TTL and idle limit
MAX_RETENTION_SECONDS = 365 * 86400  # how long a stopped sandbox may be kept

# One definition of each bound, for creates and updates alike (every API's).
SandboxName = Annotated[str, Field(pattern=NAME)]
LifetimeSeconds = Annotated[int, Field(ge=1, le=MAX_LIFETIME_SECONDS)]
RetentionSeconds = Annotated[int, Field(ge=1, le=MAX_RETENTION_SECONDS)]


class ExecDefaults(BaseModel):
    """What every command in the sandbox runs with unless it says otherwise (a command's
    own `user` and `cwd` win; its `env` is laid over these)."""

    model_config = {"extra": "forbid", "from_attributes": True}

    user: str | None = Field(default=None, min_length=1, max_length=64)
    cwd: str | None = Field(default=None, min_length=1, max_length=4096)
    env: dict[str, str] = Field(default_factory=dict, max_length=1024)
    trace_processes: bool = Field(
        default=True,
        description="record the processes each command starts (`process` events)",
    )

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        for key, item in value.items():
            if not key or "=" in key or "\x00" in key or "\x00" in item:
                raise ValueError(f"invalid environment variable {key!r}")
        return value


class AccessDelegation(BaseModel):
    """Lets code in the sandbox call cella's API (`http://cella.api`, /v1 and LangSmith's)
    as the key that created it: `inherit` everything that key may do, or `explicit`
    `permissions`: `sandboxes:read` (reads only) and `sandboxes:write` (reads and writes).
    The egress proxy adds a short-lived token to each such request, and the key is checked
    again every time: revoked, and the sandbox's calls are refused."""

    model_config = {"extra": "forbid", "from_attributes": True}

    mode: Literal["inherit", "explicit"]
    permissions: list[DelegatedPermission] = Field(default_factory=list, max_length=16)

    @model_validator(mode="after")
    def _permissions(self) -> AccessDelegation:
        if self.mode == "inherit" and self.permissions:
            raise ValueError("permissions go with mode explicit, not inherit")
        if self.mode == "explicit" and not self.permissions:
            raise ValueError("mode explicit needs permissions")
        return self


class SandboxCreate(BaseModel):
    """What a new sandbox should be. Limits are checked against the host's settings."""

    model_config = {"extra": "forbid"}

    name: SandboxName | None = Field(
        default=None, description="unique among the tenant's sandboxes"
    )
    template: str = Field(default="default", min_length=1, max_length=63)
    snapshot: str | None = Field(
        default=None,
        min_length=1,
        max_length=256,
        description="start from this snapshot (id, name:tag or name) instead of the template",
    )
    vcpus: int = Field(default=1, ge=1, le=64)
    memory_mib: int = Field(default=512, ge=128, le=262144)
    disk_mib: int | None = Field(default=None, ge=512, le=1 << 20)
    ttl_seconds: LifetimeSeconds | None = None
    idle_timeout_seconds: LifetimeSeconds | None = None
    ttl_action: ExpiryAction = Field(default="delete", description="what the TTL does")
    ttl_clock: TtlClock = Field(
        default="wall",
        description="`wall`: `ttl_seconds` counts from creation, whatever the state; "
        "`running`: time paused or stopped is not counted (a sandbox paused with 60 s "
        "left has 60 s left when it is resumed)",
    )
    auto_resume: bool = Field(
        default=False,
        description="traffic to a paused or stopped sandbox's ports (service URLs, host "
        "names; E2B's envd) resumes it, the request waiting meanwhile; when its lifetime "
        "had run out it gets its first `ttl_seconds` again (at least 300 s), from the wake",
    )
    idle_action: ExpiryAction = Field(default="stop", description="what idleness does")
    delete_after_stop_seconds: RetentionSeconds | None = Field(
        default=None, description="a stopped sandbox is deleted after this"
    )
    max_pids: int | None = Field(default=None, ge=16, le=1 << 20, description="guest processes")
    stop_keeps_memory: bool = Field(
        default=False,
        description="a stop (asked for, or on idling) pauses the VM: processes and memory "
        "are kept for the next resume, and the host keeps holding its RAM",
    )
    replicate: bool = Field(
        default=False,
        description="fleet only: keep a copy of its disk on a second node, refreshed when it "
        "stops and every `replica_interval_s`; when its node is lost it comes back there, "
        "`recovered` (a single daemon refuses it: there is no second node)",
    )
    replicate_memory: bool = Field(
        default=False,
        description="fleet only, implies `replicate`: the replica of the running sandbox "
        "keeps its memory too, a live snapshot every `replica_interval_s` (the guest pauses "
        "for the copy); when its node is lost it comes back paused, its processes going on "
        "at resume (a paused sandbox's replica keeps its memory in any case)",
    )
    checkpoint_each_exec: bool = Field(
        default=False,
        description="a checkpoint is taken after every command (named by its exec), so any "
        "command can be diffed or rewound",
    )
    restore_memory: RestoreMemory = Field(
        default="if_present",
        description="with `snapshot`: restore its memory when it has one (`if_present`), "
        "insist on it (`always`: refused for a snapshot without memory), or boot from its "
        "disk alone (`never`)",
    )
    access_delegation: AccessDelegation | None = Field(
        default=None, description="cella's API for code in the sandbox, as its creator"
    )
    visibility: Visibility | None = Field(
        default=None,
        description="`private`: its creator, the tenant's owners and whom it is shared with; "
        "`tenant`: every key of the tenant may exec in it too. Default: `tenant` for an "
        "owner's key, `private` for a member's",
    )
    exec_defaults: ExecDefaults = Field(default_factory=ExecDefaults)
    exec_policy: ExecPolicy | None = Field(
        default=None,
        description="which executables may run in the guest (its kernel refuses the rest "
        "with EPERM); kept across stop, resume and forks; changed with "
        "`PUT /v1/sandboxes/{id}/exec-policy`",
    )
    run_entrypoint: bool = Field(
        default=False,
        description="start the template image's Entrypoint + Cmd as process `entrypoint`",
    )
    labels: dict[str, str] = Field(default_factory=dict, max_length=64)
    network: NetworkPolicy = Field(
        default_factory=NetworkPolicy, description="egress rules (default: reach nothing)"
    )
    secrets: dict[str, str] = Field(
        default_factory=dict,
        max_length=64,
        description="environment variable -> secret name; the guest sees a placeholder",
    )
    mounts: list[GitMount] = Field(
        default_factory=list,
        max_length=MAX_MOUNTS,
        description="git repositories cloned in at create (through the egress rules) and "
        "refreshed while the sandbox runs; a clone that fails fails the create",
    )
    bucket_mounts: list[BucketMount] = Field(
        default_factory=list,
        max_length=MAX_MOUNTS,
        description="S3 and GCS buckets mounted in the guest (rclone) through the egress "
        "proxy, which adds the credentials their `auth` names; mounted again after a resume, "
        "restore or fork; a mount that fails fails the create",
    )
    volume_mounts: list[VolumeMount] = Field(
        default_factory=list,
        max_length=MAX_VOLUME_MOUNTS,
        description="the tenant's volumes mounted in the guest (a network file system served "
        "by the daemon through the egress proxy), shared with every sandbox mounting them; "
        "mounted again after a resume, restore or fork, never copied into a snapshot",
    )

    @model_validator(mode="after")
    def _mounts(self) -> SandboxCreate:
        both: list[GitMount | BucketMount | VolumeMount] = [
            *self.mounts,
            *self.bucket_mounts,
            *self.volume_mounts,
        ]
        check_mounts(both)
        check_bucket_auth(self.bucket_mounts)
        return self

    @model_validator(mode="after")
    def _replicated(self) -> SandboxCreate:
        if self.replicate_memory:  # a replica with memory is a replica
            self.replicate = True
        return self

    @field_validator("labels")
    @classmethod
    def _labels(cls, value: dict[str, str]) -> dict[str, str]:
        for key, item in value.items():
            if not re.match(LABEL_KEY, key):
                raise ValueError(f"invalid label key {key!r} (letters, digits, ._/-; 1-63)")
            if len(item) > 255:
                raise ValueError(f"label {key!r}: value longer than 255 characters")
        return value

    @field_validator("secrets")
    @classmethod
    def _secret_names(cls, value: dict[str, str]) -> dict[str, str]:
        for env, name in value.items():
            if not re.match(ENV_NAME, env):
                raise ValueError(f"invalid environment variable name {env!r}")
            if not re.match(SECRET_NAME, name):
                raise ValueError(f"invalid secret name {name!r}")
        return value


class SandboxUpdate(BaseModel):
    """A change to an existing sandbox, held to the same bounds as a create. A field left
    out is kept; None clears a limit."""

    model_config = {"extra": "forbid"}

    name: SandboxName | None = None
    ttl_seconds: LifetimeSeconds | None = None
    idle_timeout_seconds: LifetimeSeconds | None = None
    delete_after_stop_seconds: RetentionSeconds | None = None
    exec_defaults: ExecDefaults | None = None


class Recovery(BaseModel):
    """A sandbox brought back on another node of a fleet from its replica."""

    from_node: str = Field(description="the node that was lost")
    node: str = Field(description="the node it is on now, where its replica was")
    replica_taken_at: datetime
    replica_age_seconds: float = Field(description="how old the replica was when it came back")
    state: Literal["paused", "stopped"] = Field(
        default="stopped",
        description="what it came back as: paused (the replica kept its memory: a resume "
        "goes on with its processes) or stopped (its disk alone: a resume boots it)",
    )
    at: datetime = Field(description="when it came back")
    reason: str = Field(description="why its node was lost")


class Sandbox(BaseModel):
    model_config = {"from_attributes": True}

    id: str
    tenant: str | None = Field(default=None, description="whose it is")
    name: str | None = None
    state: SandboxState
    template: str
    vcpus: int
    memory_mib: int
    disk_mib: int | None
    ttl_seconds: int | None
    idle_timeout_seconds: int | None
    ttl_action: ExpiryAction = "delete"
    ttl_clock: TtlClock = "wall"
    auto_resume: bool = False
    idle_action: ExpiryAction = "stop"
    max_pids: int | None = None
    delete_after_stop_seconds: int | None = None
    stop_keeps_memory: bool = False
    checkpoint_each_exec: bool = False
    access_delegation: AccessDelegation | None = None
    exec_defaults: ExecDefaults = Field(default_factory=ExecDefaults)
    exec_policy: ExecPolicy | None = None
    last_active_at: datetime | None = None
    stopped_at: datetime | None = None
    labels: dict[str, str]
    network: NetworkPolicy = Field(default_factory=NetworkPolicy)
    secrets: dict[str, str] = Field(
        default_factory=dict, description="environment variable -> secret name"
    )
    mounts: list[GitMount] = Field(default_factory=list, description="git repositories")
    bucket_mounts: list[BucketMount] = Field(default_factory=list, description="S3, GCS")
    volume_mounts: list[VolumeMount] = Field(default_factory=list, description="volumes")
    mount_states: dict[str, BucketState] = Field(
        default_factory=dict, description="bucket or volume mount id -> where it is"
    )
    accel: str | None
    accel_reason: str | None
    error: str | None = None
    creator: str | None = Field(default=None, description="the principal that made it")
    visibility: Visibility = "tenant"
    shares: dict[str, str] = Field(
        default_factory=dict, description="principal -> view, exec or manage"
    )
    permission: Literal["view", "exec", "manage"] | None = Field(
        default=None, description="what the caller may do with it (in lists and inspect)"
    )
    parent_id: str | None = Field(default=None, description="sandbox this one was forked from")
    snapshot_id: str | None = Field(default=None, description="snapshot it was restored from")
    created_from: str | None = Field(
        default=None, description="pool, restore, boot, fork or recovered"
    )
    replicate: bool = Field(default=False, description="a fleet keeps a replica of it")
    replicate_memory: bool = Field(
        default=False, description="its replica keeps its memory while it runs (a fleet's)"
    )
    recovery: Recovery | None = Field(
        default=None, description="how it was brought back from its replica (a fleet's)"
    )
    created_at: datetime
    updated_at: datetime

    @field_validator("secrets", mode="before")
    @classmethod
    def _secret_refs(cls, value: Any) -> Any:
        # stored as env -> {secret, placeholder}; only the names are shown
        if isinstance(value, dict):
            return {
                k: v if isinstance(v, str) else getattr(v, "secret", v) for k, v in value.items()
            }
        return value


class SandboxList(BaseModel):
    sandboxes: list[Sandbox]


class Event(BaseModel):
    model_config = {"from_attributes": True}

    id: int
    sandbox_id: str
    type: str
    at: datetime
    data: dict[str, Any] = Field(default_factory=dict)


class EventList(BaseModel):
    events: list[Event]


class LineageNode(BaseModel):
    """A sandbox, or a snapshot of one; a snapshot's children are the forks made from it."""

    kind: Literal["sandbox", "snapshot"]
    id: str
    name: str | None = None
    state: str
    created_at: datetime
    eval: LineageEval | None = Field(default=None, description="the eval task it ran")
    children: list[LineageNode] = Field(default_factory=list)


class LineageEval(BaseModel):
    run_id: str
    task_id: str
    passed: bool
    score: float


class SnapshotState(StrEnum):
    creating = "creating"
    ready = "ready"
    deleted = "deleted"
    error = "error"


class SnapshotCreate(BaseModel):
    model_config = {"extra": "forbid"}

    name: str = Field(default="snapshot", min_length=1, max_length=128)
    docker_image: str | None = Field(
        default=None,
        min_length=1,
        max_length=1024,
        description="an image in the sandbox's own Docker to snapshot instead of the VM "
        "(answers `creating`: poll the snapshot)",
    )
    disk_mib: int | None = Field(default=None, ge=512, le=1 << 20)
    memory: bool = Field(
        default=True,
        description="keep the VM's memory too (sandboxes made from it run on where it was); "
        "false: the disk alone, which sandboxes boot from",
    )


class StopRequest(BaseModel):
    model_config = {"extra": "forbid"}

    memory: bool | None = Field(
        default=None,
        description="keep processes and memory (a pause) or not (a stop); "
        "default: the sandbox's `stop_keeps_memory`",
    )


class Snapshot(BaseModel):
    model_config = {"from_attributes": True}

    id: str
    tenant: str | None = Field(default=None, description="whose it is")
    name: str
    sandbox_id: str = Field(description="the sandbox it was taken from")
    parent_snapshot_id: str | None = None
    state: SnapshotState
    template: str
    vcpus: int
    memory_mib: int
    memory: bool = Field(default=True, description="false: its disk alone")
    size_bytes: int | None = None
    paused_ms: float | None = Field(default=None, description="how long the source was paused")
    error: str | None = None
    created_at: datetime


class SnapshotList(BaseModel):
    snapshots: list[Snapshot]


class ForkRequest(BaseModel):
    model_config = {"extra": "forbid"}

    count: int = Field(default=1, ge=1, le=MAX_FORKS)


class SandboxUsage(BaseModel):
    """Limits and live usage. Guest figures are absent while the sandbox is not running."""

    id: str
    state: SandboxState
    vcpus: int
    memory_mib: int
    disk_mib: int | None
    max_pids: int | None
    ttl_seconds: int | None
    ttl_remaining_seconds: float | None
    idle_timeout_seconds: int | None
    cpu_seconds: float | None = Field(default=None, description="CPU time of the VM on the host")
    host_memory_mib: float | None = Field(default=None, description="PSS of the VM's QEMU")
    guest_memory_used_mib: float | None = None
    guest_memory_total_mib: float | None = None
    guest_disk_used_mib: float | None = None
    guest_disk_total_mib: float | None = None
    disk_allocated_mib: float = Field(description="host space the sandbox's overlays take")
    pids: int | None = None
