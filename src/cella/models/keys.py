"""API keys and tenants."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, Field

TENANT = r"^[a-z0-9][a-z0-9_-]{0,62}$"


class KeyCreate(BaseModel):
    model_config = {"extra": "forbid"}

    tenant: str = Field(pattern=TENANT)


class KeyCreated(BaseModel):
    id: str
    tenant: str
    key: str = Field(description="shown once; only its hash is stored")


class KeyInfo(BaseModel):
    model_config = {"from_attributes": True}

    id: str
    tenant: str
    created_at: datetime
    admin: bool
