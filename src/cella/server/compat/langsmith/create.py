"""A LangSmith box create, read once for both places that take it: the node daemon, which
makes the sandbox (`control.py`), and the fleet gateway, which places it first on a node
(`cella.fleet.langsmith`). What cella cannot honour is refused here; what only a daemon
knows (the tenant's egress rules and secrets, its snapshots, its templates' disks) it adds
to the read create itself."""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from cella import errors
from cella.models import BucketMount, GitMount, NetworkPolicy, SandboxCreate
from cella.server.compat.langsmith.mounts import Secret, mounts_of
from cella.server.compat.langsmith.shapes import DEFAULT_IDLE_TTL, exec_defaults, not_supported
from cella.server.error_shapes import describe

Json = dict[str, Any]
MIB = 1 << 20
SNAPSHOT_FIELDS = ("snapshot_id", "snapshot", "snapshot_name")  # the first given counts
# LangSmith's names for cella's fields, in what a refusal says
LANGSMITH_NAMES = {"idle_timeout_seconds": "idle_ttl_seconds", "exec_defaults": "run_config"}
CELLA_NAMES = {v: k for k, v in LANGSMITH_NAMES.items()}
Model = TypeVar("Model", bound=BaseModel)


@dataclass(frozen=True, slots=True)
class BoxCreate:
    """What a create asks for, in cella's terms."""

    name: str  # the caller's, or one made up (the same wherever the create goes next)
    snapshot: str | None  # the snapshot to boot from: an id, name or name:tag
    vcpus: int | None  # as given (None: the model's default, or the snapshot's)
    mem_bytes: int | None
    fs_capacity_mib: int | None
    proxy_config: Any  # LangSmith's egress rules, as given (None: none)
    settings: Json  # lifetime, idleness and run_config as cella's create fields
    mounts: tuple[GitMount, ...] = ()  # mount_config's git mounts
    bucket_mounts: tuple[BucketMount, ...] = ()  # its s3 and gcs mounts (auth to resolve)
    mount_auth: tuple[tuple[str, Secret], ...] = ()  # its auth's secrets, not yet stored

    def check_snapshot_shape(self, vcpus: int, memory_mib: int) -> None:
        """A size given with a snapshot must be the snapshot's."""
        for field, given, have in (
            ("vcpus", self.vcpus, vcpus),
            ("mem_bytes", self.mem_bytes, memory_mib * MIB),
        ):
            if given is not None and given != have:
                raise errors.InvalidArgument(
                    f"{field}: a sandbox booted from a snapshot has the snapshot's ({have})"
                )

    def spec(
        self,
        *,
        snapshot_id: str | None = None,
        network: NetworkPolicy | None = None,
        disk_mib: int | None = None,
        bucket_mounts: list[BucketMount] | None = None,
    ) -> SandboxCreate:
        """The cella create (the model's defaults for what the box does not say), with what
        a daemon found: the snapshot's id, the egress rules, a disk larger than the
        template's."""
        fields: Json = {"name": self.name, **self.settings}
        if self.mounts:
            fields["mounts"] = list(self.mounts)
        buckets = self.bucket_mounts if bucket_mounts is None else bucket_mounts
        if buckets:
            fields["bucket_mounts"] = list(buckets)
        if network is not None:
            fields["network"] = network
        if snapshot_id is not None:
            fields["snapshot"] = snapshot_id
        elif self.snapshot is None:
            if self.vcpus is not None:
                fields["vcpus"] = self.vcpus
            if self.mem_bytes is not None:
                fields["memory_mib"] = max(128, math.ceil(self.mem_bytes / MIB))
        if disk_mib is not None:
            fields["disk_mib"] = disk_mib
        return validated(SandboxCreate, fields)


# the create fields cella reads (`timeout` and `wait_for_ready` are the control plane's)
READ = {
    "name", *SNAPSHOT_FIELDS, "vcpus", "mem_bytes", "fs_capacity_bytes", "proxy_config",
    "mount_config", "idle_ttl_seconds", "delete_after_stop_seconds", "run_config",
    "preserve_memory_on_stop", "restore_memory", "access_delegation", "labels", "persistent",
    "timeout", "wait_for_ready",
}  # fmt: skip


def read_create(body: Json) -> BoxCreate:
    """A LangSmith create's body, read; what cella cannot honour is refused by name, never
    ignored."""
    unknown = sorted(field for field in set(body) - READ if body[field] is not None)
    if unknown:
        raise not_supported(f"creating a sandbox with {unknown}")
    if flag(body, "persistent") is False:
        raise not_supported("persistent: false (a sandbox's files always survive its stops)")
    snapshot = next((body[f] for f in SNAPSHOT_FIELDS if body.get(f)), None)
    fs_bytes = body.get("fs_capacity_bytes")
    git, buckets, auth = (
        mounts_of(body["mount_config"]) if body.get("mount_config") else ([], [], {})
    )
    return BoxCreate(
        name=body.get("name") or f"sandbox-{secrets.token_hex(4)}",
        snapshot=str(snapshot) if snapshot else None,
        vcpus=None if body.get("vcpus") is None else int(body["vcpus"]),
        mem_bytes=None if body.get("mem_bytes") is None else int(body["mem_bytes"]),
        fs_capacity_mib=None if fs_bytes is None else math.ceil(int(fs_bytes) / MIB),
        proxy_config=body.get("proxy_config"),
        mounts=tuple(git),
        bucket_mounts=tuple(buckets),
        mount_auth=tuple(auth.items()),
        settings={
            "idle_timeout_seconds": seconds(body, "idle_ttl_seconds", DEFAULT_IDLE_TTL),
            "idle_action": "stop",
            "delete_after_stop_seconds": seconds(body, "delete_after_stop_seconds"),
            "exec_defaults": exec_defaults(body.get("run_config")),
            "stop_keeps_memory": flag(body, "preserve_memory_on_stop") or False,
            "restore_memory": RESTORE_MEMORY[flag(body, "restore_memory")],
            "access_delegation": delegation_of(body.get("access_delegation")),
            "labels": body.get("labels") or {},
        },
    )


def delegation_of(given: Any) -> Json | None:
    """LangSmith's access_delegation (mode INHERIT or EXPLICIT) as cella's; the model checks
    the permissions (`sandboxes:read`, `sandboxes:write`)."""
    if given is None:
        return None
    if not isinstance(given, dict) or not isinstance(given.get("mode"), str):
        raise errors.InvalidArgument("access_delegation: an object with a mode")
    return {**given, "mode": given["mode"].lower()}


# LangSmith's restore_memory (nil, true, false) as cella's
RESTORE_MEMORY = {None: "if_present", True: "always", False: "never"}


def flag(body: Json, field: str) -> bool | None:
    """A boolean field of the body (None: not given); anything else is refused."""
    value = body.get(field)
    if value is not None and not isinstance(value, bool):
        raise errors.InvalidArgument(f"{field}: must be true or false, not {value!r}")
    return value


def validated(model: type[Model], fields: Json) -> Model:
    """`fields` as `model`, or a 422 that names LangSmith's fields."""
    try:
        return model.model_validate(fields)
    except ValidationError as exc:
        problems = [
            {**p, "loc": [LANGSMITH_NAMES.get(str(part), part) for part in p["loc"]]}
            for p in exc.errors()
        ]
        raise errors.InvalidArgument(describe(problems)) from None


def seconds(body: Json, field: str, default: Any = None) -> Any:
    """LangSmith's retention seconds: 0 (or none) is "never"; the model checks the rest."""
    value = body.get(field, default)
    if value is None or value == 0:
        return None
    if isinstance(value, int | float) and value < 0:
        raise errors.InvalidArgument(f"{field}: must be 0 or more, not {value}")
    return value
