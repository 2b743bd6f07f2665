"""Servers in a sandbox, reached from outside: service URLs."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, Field


class ExposeRequest(BaseModel):
    model_config = {"extra": "forbid"}

    expires_in_seconds: int = Field(default=600, ge=1, le=86400)


class ExposedPort(BaseModel):
    port: int
    url: str = Field(description="service URL: requests need the token (header or cookie)")
    browser_url: str = Field(description="the same URL carrying the token once, for a browser")
    token: str = Field(description="send as X-Cella-Service-Token")
    expires_at: datetime


class LoginUrl(BaseModel):
    port: int
    url: str = Field(
        description="a login-mode service URL: requests need a key or console session of the "
        "sandbox's tenant; the server gets X-Langsmith-User-Token, signed by the daemon"
    )
    jwks_url: str = Field(description="where the server finds the keys to verify it with")
