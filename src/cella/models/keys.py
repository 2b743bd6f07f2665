"""API keys and tenants."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, Field

TENANT = r"^[a-z0-9][a-z0-9_-]{0,62}$"


class KeyCreate(BaseModel):
    model_config = {"extra": "forbid"}

    tenant: str = Field(pattern=TENANT)
    read_only: bool = Field(default=False, description="GET and HEAD only: look, never change")


class KeyCreated(BaseModel):
    id: str
    tenant: str
    key: str = Field(description="shown once; only its hash is stored")
    read_only: bool = False


class KeyInfo(BaseModel):
    model_config = {"from_attributes": True}

    id: str
    tenant: str
    created_at: datetime
    admin: bool
    read_only: bool = False


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
