"""API keys and tenants."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field

from cella.models.access import PrincipalName
from cella.policy.access import Role

TENANT = r"^[a-z0-9][a-z0-9_-]{0,62}$"
KeyFormat = Literal["cella", "e2b"]


class KeyCreate(BaseModel):
    model_config = {"extra": "forbid"}

    tenant: str = Field(pattern=TENANT)
    read_only: bool = Field(
        default=False, description="GET and HEAD only: look, never change (adds `viewer`)"
    )
    principal: PrincipalName | None = Field(
        default=None, description="the person or service holding it (default: the key's id)"
    )
    roles: list[Role] | None = Field(
        default=None,
        max_length=2,
        description="`owner` (every sandbox of the tenant; the default), `member` (its "
        "own, the tenant's and those shared with it), `viewer` (reads only)",
    )
    format: KeyFormat = Field(
        default="cella",
        description="`cella` (`ck_...`) or `e2b` (`e2b_` and hex, the only form some E2B "
        "SDKs send); either is accepted everywhere a key is",
    )


class KeyCreated(BaseModel):
    id: str
    tenant: str
    key: str = Field(description="shown once; only its hash is stored")
    read_only: bool = False
    principal: str = ""
    roles: list[Role] = Field(default_factory=list)


class KeyInfo(BaseModel):
    model_config = {"from_attributes": True}

    id: str
    tenant: str
    created_at: datetime
    admin: bool
    read_only: bool = False
    principal: str | None = Field(default=None, description="None: the key's id")
    roles: list[Role] = Field(default_factory=list)


class KeyUseInfo(BaseModel):
    """One request made with a key (the audit log)."""

    model_config = {"from_attributes": True}

    id: int
    key_id: str
    tenant: str
    at: datetime
    method: str
    path: str
    status: int
    client: str | None


class SigningKeyInfo(BaseModel):
    kid: str = Field(description="the key's id: its RFC 7638 thumbprint")
    created_at: datetime
    current: bool = Field(description="the key that signs now; the others only verify")


class SigningKeys(BaseModel):
    keys: list[SigningKeyInfo]
