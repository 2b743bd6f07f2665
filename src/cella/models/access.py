"""Who may use a sandbox, on the wire (the rule itself: `cella.policy.access`)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from cella.policy.access import PRINCIPAL, Visibility

PrincipalName = Annotated[str, Field(pattern=PRINCIPAL, description="a person or service")]
Level = Literal["view", "exec", "manage"]
MAX_SHARES = 256


class SandboxAccess(BaseModel):
    """Who may use a sandbox besides its creator and the tenant's owners: `visibility`
    `tenant` lets every key of the tenant exec in it, `private` only those it is shared
    with. `shares`: principal -> `view` (inspect, trace, read files), `exec` (also run
    commands, write files, open ports, snapshot, fork, resume) or `manage` (also stop,
    pause, delete, change it, its network and who may use it)."""

    model_config = {"extra": "forbid", "from_attributes": True}

    visibility: Visibility = "private"
    shares: dict[PrincipalName, Level] = Field(default_factory=dict, max_length=MAX_SHARES)


class SandboxAccessView(SandboxAccess):
    """A sandbox's access as shown: who made it, and what the caller may do with it."""

    creator: str | None = Field(description="its creator's principal (None: made before)")
    creator_key: str | None = Field(default=None, description="the key that made it")
    permission: Level | None = Field(
        description="what the caller may do with it (None: after a change that took its "
        "access away, nothing)"
    )
