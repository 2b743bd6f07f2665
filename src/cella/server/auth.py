"""API keys: `ck_<random>`; only their SHA-256 is stored. A key belongs to one tenant."""

from __future__ import annotations

import hashlib
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from cella import errors
from cella.store import Store

ADMIN_TENANT = "admin"


@dataclass(frozen=True, slots=True)
class Principal:
    tenant: str
    admin: bool


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key(store: Store, tenant: str, admin: bool = False) -> tuple[str, str]:
    """Creates a key; returns (key id, the key itself - never stored)."""
    key = f"ck_{secrets.token_urlsafe(32)}"
    key_id = f"key-{secrets.token_hex(6)}"
    store.add_key(key_id, tenant, hash_key(key), admin)
    return key_id, key


def ensure_admin_key(store: Store, data_dir: Path) -> Path:
    """On first start, writes a local admin key to DIR/admin.key (0600)."""
    path = data_dir / "admin.key"
    if path.exists() and store.key_by_hash(hash_key(path.read_text().strip())):
        return path
    _, key = new_key(store, ADMIN_TENANT, admin=True)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    tmp.rename(path)
    return path


def authenticate(store: Store, authorization: str | None) -> Principal:
    if not authorization:
        raise errors.Unauthenticated("an API key is required (Authorization: Bearer <key>)")
    scheme, _, key = authorization.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise errors.Unauthenticated("use Authorization: Bearer <key>")
    row = store.key_by_hash(hash_key(key.strip()))
    if row is None:
        raise errors.Unauthenticated("unknown or revoked API key")
    return Principal(tenant=row["tenant"], admin=bool(row["admin"]))
