"""A sandbox's row: built for a create or a fork (`new_record`), and read back as the create
it was made with (`spec_of`), so a fork of it is made the same way."""

from __future__ import annotations

from typing import Any

from cella.models import SandboxCreate, SandboxState
from cella.policy import access
from cella.policy.access import Principal
from cella.service.rewrites import setter_of
from cella.store import SandboxRecord, SecretRef

S = SandboxState


def new_record(
    who: Principal,
    sandbox_id: str,
    spec: SandboxCreate,
    secrets: dict[str, SecretRef],
    created_from: str,
    inherited_setter: dict[str, Any] | None = None,
    **lineage: Any,
) -> SandboxRecord:
    """The row of a sandbox about to be made (`creating`): by create or by fork, by `who`
    (its creator, whose it is: `cella.policy.access`). Its rewrite rules are `who`'s,
    unless they are a fork's inherited ones: `inherited_setter` set them."""
    setter = inherited_setter if spec.network.rewrites else None
    return SandboxRecord(
        id=sandbox_id,
        tenant=who.tenant,
        creator_key=who.key_id,
        creator=who.principal or None,
        visibility=spec.visibility or access.default_visibility(who),
        state=S.creating,
        name=spec.name,
        template=spec.template,
        vcpus=spec.vcpus,
        memory_mib=spec.memory_mib,
        disk_mib=spec.disk_mib,
        ttl_seconds=spec.ttl_seconds,
        idle_timeout_seconds=spec.idle_timeout_seconds,
        ttl_action=spec.ttl_action,
        ttl_clock=spec.ttl_clock,
        auto_resume=spec.auto_resume,
        wake_ttl_seconds=spec.ttl_seconds,
        idle_action=spec.idle_action,
        max_pids=spec.max_pids,
        delete_after_stop_seconds=spec.delete_after_stop_seconds,
        stop_keeps_memory=spec.stop_keeps_memory,
        checkpoint_each_exec=spec.checkpoint_each_exec,
        exec_defaults=spec.exec_defaults,
        exec_policy=spec.exec_policy,
        labels=dict(spec.labels),
        network=spec.network,
        rewrite_setter=setter or setter_of(who, spec.network),
        secrets=secrets,
        mounts=list(spec.mounts),
        bucket_mounts=list(spec.bucket_mounts),
        volume_mounts=list(spec.volume_mounts),
        created_from=created_from,
        **lineage,
    )


def spec_of(row: SandboxRecord) -> SandboxCreate:
    """What a sandbox was made with, so a fork of it is made the same way."""
    return SandboxCreate.model_construct(
        template=row.template,
        vcpus=row.vcpus,
        memory_mib=row.memory_mib,
        disk_mib=row.disk_mib,
        ttl_seconds=row.ttl_seconds,
        idle_timeout_seconds=row.idle_timeout_seconds,
        ttl_action=row.ttl_action,
        ttl_clock=row.ttl_clock,
        auto_resume=row.auto_resume,
        idle_action=row.idle_action,
        max_pids=row.max_pids,
        delete_after_stop_seconds=row.delete_after_stop_seconds,
        stop_keeps_memory=row.stop_keeps_memory,
        checkpoint_each_exec=row.checkpoint_each_exec,
        exec_defaults=row.exec_defaults,
        exec_policy=row.exec_policy,
        labels=row.labels,
        network=row.network,
        secrets={k: v.secret for k, v in row.secrets.items()},
        mounts=row.mounts,
        bucket_mounts=row.bucket_mounts,
        volume_mounts=row.volume_mounts,
    )
