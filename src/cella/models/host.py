"""What this host has and has promised: the figures a placer (a fleet gateway) reads."""

from __future__ import annotations

from pydantic import BaseModel, Field, computed_field


class Capacity(BaseModel):
    """RAM and vCPUs this host may commit (`max_host_*`), and what live sandboxes and the
    warm pool's idle VMs hold of them now."""

    memory_mib: int = Field(description="the host's commitment limit")
    memory_mib_committed: int
    vcpus: int = Field(description="the host's commitment limit")
    vcpus_committed: int
    live_sandboxes: int

    @computed_field  # type: ignore[prop-decorator]
    @property
    def memory_mib_free(self) -> int:
        return max(0, self.memory_mib - self.memory_mib_committed)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def vcpus_free(self) -> int:
        return max(0, self.vcpus - self.vcpus_committed)


class BackupRequest(BaseModel):
    """A backup of the daemon's data directory (`cella backup`), written on its host."""

    dest: str = Field(
        min_length=1,
        description="a new or empty directory on the daemon's host (absolute path)",
    )
    with_secrets_key: bool = Field(
        default=False,
        description="include the sealed secrets' key (else the restore needs it given)",
    )
