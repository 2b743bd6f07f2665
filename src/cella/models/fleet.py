"""Wire types of a fleet: snapshots moving between nodes, and the fleet's status."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, Field

from cella.models.host import Capacity
from cella.models.sandbox import SandboxCreate, Snapshot


class SecretBinding(BaseModel):
    secret: str
    placeholder: str = Field(description="what the guest holds in place of the value")


class SnapshotExport(BaseModel):
    """What another node needs to take in this snapshot: its row, its manifest (the files'
    checksums), how its sandbox was made, and what its disk is an overlay on."""

    snapshot: Snapshot
    tenant: str
    manifest: dict[str, Any]
    source: SandboxCreate = Field(description="how the snapshot's sandbox was made")
    secrets: dict[str, SecretBinding] = Field(default_factory=dict)
    backing_snapshot_id: str | None = Field(
        default=None, description="its disk is an overlay on this snapshot's disk"
    )
    backing_path: str | None = Field(
        default=None, description="else on this image file (a template base, content-addressed)"
    )


class SnapshotImport(BaseModel):
    """Pull a snapshot (and the snapshots its disk sits on) from another node daemon."""

    model_config = {"extra": "forbid"}

    source_url: str = Field(pattern=r"^https?://", description="the node daemon holding it")
    source_key: str = Field(min_length=1, description="an admin key of that daemon")
    source_ca: str | None = Field(
        default=None,
        max_length=65536,
        description="PEM certificate to trust for an https source_url (a node's own)",
    )
    snapshot_id: str = Field(pattern=r"^snap-[0-9a-f]{16}$")


class Replica(BaseModel):
    """The copy of a replicated sandbox's disk a fleet keeps on a second node."""

    sandbox_id: str
    node: str | None = Field(default=None, description="where the copy is (none yet: null)")
    taken_at: datetime | None = Field(default=None, description="when the disk was copied")
    age_seconds: float | None = None
    size_bytes: int | None = None
    error: str | None = Field(default=None, description="why the last refresh failed")


class ReplicaRecover(BaseModel):
    """A node makes a replica it holds into the lost sandbox again, stopped, same id."""

    model_config = {"extra": "forbid"}

    sandbox_id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
    name: str | None = None
    creator: str | None = None
    visibility: str | None = None
    event: dict[str, Any] = Field(default_factory=dict, description="the `recovered` event's")


class FleetNode(BaseModel):
    """One node of the fleet as the gateway sees it."""

    name: str
    node_id: str = Field(description="Ray's NodeID of the node's current raylet")
    url: str | None = None
    healthy: bool
    reason: str | None = Field(default=None, description="why it is not healthy")
    capacity: Capacity | None = None
    sandboxes: int = 0
    snapshots: list[str] = Field(default_factory=list, description="snapshots held (ids)")
    templates: list[str] = Field(default_factory=list, description="templates built")
    accel: str | None = None
    pool: dict[str, int] = Field(default_factory=dict, description="warm VMs ready per shape")
    proxy_running: bool | None = Field(default=None, description="its egress proxy is up")


class FleetStatus(BaseModel):
    nodes: list[FleetNode]
    lost_sandboxes: int = Field(default=0, description="sandboxes of nodes that were lost")
