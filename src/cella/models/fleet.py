"""Wire types of a fleet: snapshots moving between nodes, and the fleet's status."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, Field

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


class FromNode(BaseModel):
    """Where an import pulls from: another node daemon, with its admin key."""

    model_config = {"extra": "forbid"}

    source_url: str = Field(pattern=r"^https?://", description="the node daemon holding it")
    source_key: str = Field(min_length=1, description="an admin key of that daemon")
    source_ca: str | None = Field(
        default=None,
        max_length=65536,
        description="PEM certificate to trust for an https source_url (a node's own)",
    )


class TemplateImport(FromNode):
    """Pull a template (its record and base image) from another node daemon."""

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


class SnapshotImport(FromNode):
    """Pull a snapshot (and the snapshots its disk sits on) from another node daemon."""

    snapshot_id: str = Field(pattern=r"^snap-[0-9a-f]{16}$")


class Replica(BaseModel):
    """The copy of a replicated sandbox's disk (and memory, when it was paused or keeps
    its memory) a fleet keeps on a second node."""

    sandbox_id: str
    node: str | None = Field(default=None, description="where the copy is (none yet: null)")
    taken_at: datetime | None = Field(default=None, description="when the disk was copied")
    age_seconds: float | None = None
    size_bytes: int | None = None
    memory: bool = Field(
        default=False,
        description="the copy holds its memory too: the sandbox comes back from it paused",
    )
    paused_ms: float | None = Field(
        default=None,
        description="how long the guest was paused for the copy (a running sandbox's)",
    )
    replicate_memory: bool = Field(
        default=False, description="a running sandbox's copy is taken with its memory"
    )
    error: str | None = Field(default=None, description="why the last refresh failed")


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
    cordoned: bool = Field(default=False, description="the planner places nothing new here")


class FleetGrowth(BaseModel):
    """The fleet and Ray's autoscaler (`fleet_autoscale`)."""

    waiting_creates: int = Field(description="creates waiting for a node to join")
    nodes_asked: int = Field(description="the floor of sandbox nodes asked for (0: none)")
    held_nodes: list[str] = Field(description="nodes with sandboxes, held against removal")
    released_nodes: list[str] = Field(description="idle nodes let go, not yet removed")


class FleetStatus(BaseModel):
    nodes: list[FleetNode]
    lost_sandboxes: int = Field(default=0, description="sandboxes of nodes that were lost")
    autoscale: FleetGrowth | None = Field(default=None, description="with fleet_autoscale")


# -- moving a sandbox between nodes ---------------------------------------------------------


class SandboxExport(BaseModel):
    """A sandbox frozen on its node for a move (`POST /v1/sandboxes/{id}/export`): its row
    as stored (id, name, tenant, spec, egress rules, secrets' bindings, exec policy,
    labels, delegation), the snapshot that carries its disk (and memory, unless it was
    stopped), and the state it had."""

    sandbox: dict[str, Any] = Field(description="the sandbox's row, column by column")
    state: Literal["running", "paused", "stopped"] = Field(description="what it resumes as")
    snapshot_id: str
    held_ms: float = Field(description="how long the guest has been paused so far")
    bytes: int = Field(description="the snapshot's files, as shipped")
    snapshot: SnapshotExport | None = Field(
        default=None,
        description="what the destination needs to take the snapshot in (else it asks); a "
        "running sandbox's is a RAM layer over the file its memory sits on",
    )


class SandboxImport(FromNode):
    """Take in a sandbox another node exported, under the same id (`POST
    /v1/sandboxes/import`): its snapshot pulled from that node, then restored."""

    export: SandboxExport


class SandboxImported(BaseModel):
    """What a node took in: the sandbox as it is here now, and what it cost."""

    sandbox: dict[str, Any]
    transfer_ms: float = Field(description="pulling and checking the snapshot's files")
    restore_ms: float = Field(description="its VM restored (or its disk laid out) here")
    bytes: int | None = Field(
        default=None, description="bytes pulled for it (what a pre-copy sent is not)"
    )


class PrecopyOffer(BaseModel):
    """What a running sandbox's node lets another pull before the sandbox freezes for its
    move (`POST /v1/sandboxes/{id}/precopy`): its disk as written so far, frozen as a
    snapshot without memory (the guest writes a new overlay on it meanwhile), and the RAM
    file its memory sits on (a restored VM's), by digest."""

    sandbox_id: str
    snapshot_id: str | None = Field(default=None, description="its disk so far, frozen")
    ram_sha256: str | None = Field(
        default=None, description="the RAM file under its memory (`GET .../precopy/ram`)"
    )
    split_ms: float = Field(default=0.0, description="the disk split and frozen copy made")


class PrecopyTake(FromNode):
    """Pull what a sandbox's node offers ahead of its move (`POST /v1/sandboxes/precopy`)."""

    offer: PrecopyOffer


class PrecopyTaken(BaseModel):
    bytes: int = Field(description="bytes that travelled")
    pull_ms: float = Field(description="pulling and checking them")


class MoveRequest(BaseModel):
    model_config = {"extra": "forbid"}

    node: str | None = Field(default=None, description="the node to move to; else planned")


class MoveReport(BaseModel):
    """One sandbox's move: where from and to, the guest's pause and what was shipped; or,
    when it failed, why (the sandbox is then still where it was, as it was)."""

    id: str
    source: str = Field(
        validation_alias=AliasChoices("source", "from"),
        serialization_alias="from",
        description="the node it left",
    )
    to: str | None = None
    state: str = Field(description="the sandbox's state, kept across the move")
    ok: bool
    paused_ms: float | None = Field(
        default=None, description="the guest's pause, from its freeze to its restore there"
    )
    bytes: int | None = Field(
        default=None, description="bytes shipped while the guest was frozen (after a pre-copy)"
    )
    transfer_ms: float | None = Field(
        default=None, description="the destination pulling and checking them"
    )
    precopy_ms: float | None = Field(
        default=None, description="the pre-copy, before the freeze: the guest ran meanwhile"
    )
    precopy_bytes: int | None = Field(
        default=None, description="bytes shipped before the freeze (the disk and RAM so far)"
    )
    error: str | None = None


class DrainReport(BaseModel):
    node: str
    cordoned: bool
    moves: list[MoveReport]


class ReplicaRecover(BaseModel):
    """A node makes a replica it holds into the lost sandbox again, same id: paused when
    the copy has its memory, else stopped."""

    model_config = {"extra": "forbid"}

    export: SandboxExport = Field(description="what the sandbox's node answered for the copy")
    event: dict[str, Any] = Field(default_factory=dict, description="the `recovered` event's")
