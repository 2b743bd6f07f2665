"""Wire types of a fleet: snapshots moving between nodes, and the fleet's status."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from cella.models.host import Capacity
from cella.models.sandbox import SandboxCreate, Snapshot
from cella.models.templates import TEMPLATE_NAME


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


class TemplateExport(BaseModel):
    """What another node needs to take in a template built from an image: its record and
    its base image's digest and size, checked on arrival."""

    template: dict[str, Any] = Field(description="the template's record on its node")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    bytes: int = Field(ge=0)


class TemplateImport(BaseModel):
    """Pull a template (its record and base image) from another node daemon."""

    model_config = {"extra": "forbid"}

    source_url: str = Field(pattern=r"^https?://", description="the node daemon holding it")
    source_key: str = Field(min_length=1, description="an admin key of that daemon")
    source_ca: str | None = Field(
        default=None,
        max_length=65536,
        description="PEM certificate to trust for an https source_url (a node's own)",
    )
    source_node: str | None = Field(
        default=None, max_length=128, description="the source's node name, recorded"
    )
    name: str = Field(pattern=TEMPLATE_NAME)


class TemplateShip(BaseModel):
    """Ship a template built through the gateway to nodes ahead of their first sandbox."""

    model_config = {"extra": "forbid"}

    nodes: list[str] | None = Field(
        default=None, max_length=1000, description="node names (default: every healthy node)"
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
