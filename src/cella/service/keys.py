"""API keys and who they belong to: `ck_<random>` (or `e2b_<hex>`, the form E2B's SDKs
accept), only their SHA-256 is stored. A key
belongs to one tenant and one principal (a person or service: by default the key's id)
with roles (`cella.policy.access`: which of the tenant's sandboxes it may use); admin keys
manage keys. The local admin key is written on first
start to `DATA_DIR/admin.key` (0600), where the SDK and CLI on the same host find it."""

from __future__ import annotations

import hashlib
import os
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cella import errors
from cella.config import ADMIN_KEY_FILE
from cella.models import SandboxState
from cella.policy import delegation
from cella.policy.access import Principal as Principal  # where the service and doors find it
from cella.policy.access import Role, roles_of
from cella.store import KeyRecord, KeyUse, Store
from cella.store.db import now

ADMIN_TENANT = "admin"
GONE = (SandboxState.deleting, SandboxState.deleted, SandboxState.error)


@dataclass(frozen=True, slots=True)
class Grant:
    """A sandbox's access delegation as a token is checked against it: whose sandbox, and
    its grant (mode, permissions, the creator's key id, the key tokens are minted with)."""

    tenant: str
    delegation: dict[str, object]


GrantOf = Callable[[str], "Grant | None"]  # a live sandbox's grant, by its id


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class Keys:
    def __init__(self, store: Store, grant_of: GrantOf | None = None) -> None:
        """`grant_of`: where the grants of delegation tokens are found (a daemon: its
        sandboxes' rows; a fleet gateway: the grants it made for the sandboxes it placed)."""
        self.store = store
        self.grant_of = grant_of or self._row_grant

    def create(
        self,
        tenant: str,
        admin: bool = False,
        read_only: bool = False,
        principal: str | None = None,
        roles: list[Role] | None = None,
        form: str = "cella",
    ) -> tuple[str, str]:
        """Creates a key; returns (key id, the key itself - never stored). Its roles are
        `owner` unless told (`viewer` added by `read_only`). `form` `e2b`: `e2b_` and 40
        hex digits (what E2B's SDKs check a key against), else `ck_...`."""
        try:
            held = roles_of(roles, read_only)
        except ValueError as exc:
            raise errors.InvalidArgument(str(exc)) from None
        read_only = Role.viewer in held
        if admin and read_only:
            raise errors.InvalidArgument("an admin key cannot be read-only")
        if admin and Role.owner not in held:
            raise errors.InvalidArgument("an admin key is its tenant's owner")
        key = f"e2b_{secrets.token_hex(20)}" if form == "e2b" else f"ck_{secrets.token_urlsafe(32)}"
        key_id = f"key-{secrets.token_hex(6)}"
        self.store.add_key(key_id, tenant, hash_key(key), admin, read_only, principal, held)
        return key_id, key

    def ensure_admin_key(self, data_dir: Path) -> Path:
        """On first start (or if the file's key was revoked), writes a local admin key."""
        path = data_dir / ADMIN_KEY_FILE
        if path.exists() and self.store.key_by_hash(hash_key(path.read_text().strip())):
            return path
        _, key = self.create(ADMIN_TENANT, admin=True)
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(key + "\n")
        tmp.rename(path)
        return path

    def authenticate(self, key: str) -> Principal:
        if key.startswith(delegation.PREFIX):
            return self.delegated(key)
        row = self.store.key_by_hash(hash_key(key))
        if row is None:
            raise errors.Unauthenticated("unknown or revoked API key")
        return holder(row)

    def delegated(self, token: str) -> Principal:
        """Whom a sandbox's delegation token acts as, checked now: fresh, from a live
        sandbox with a grant, whose creator's key is still valid; its creator's principal
        and roles (it sees what its creator sees), limited as the grant says (`explicit`
        without `sandboxes:write` reads only; admin rights pass by `inherit`)."""
        sandbox_id = delegation.sandbox_of(token)
        found = self.grant_of(sandbox_id) if sandbox_id else None
        if found is None:
            raise errors.Unauthenticated("not a valid delegation token")
        grant = found.delegation
        if not delegation.valid(token, bytes.fromhex(str(grant["key"]))):
            raise errors.Unauthenticated("an expired or forged delegation token")
        key = self.store.key_by_id(str(grant["key_id"]))
        if key is None or key.tenant != found.tenant:
            raise errors.Unauthenticated(
                f"sandbox {sandbox_id} acts for a key that was revoked: its access ended with it"
            )
        inherit = grant["mode"] == "inherit"
        permissions = grant.get("permissions")
        writes = inherit or (isinstance(permissions, list) and "sandboxes:write" in permissions)
        creator = holder(key)
        return Principal(
            key.tenant,
            key.admin and inherit,
            key.read_only or not writes,
            key.id,
            creator.name,
            creator.roles,
        )

    def _row_grant(self, sandbox_id: str) -> Grant | None:
        row = self.store.get_sandbox(sandbox_id)
        if row is None or not row.delegation or row.state in GONE:
            return None
        return Grant(row.tenant, row.delegation)

    def by_id(self, key_id: str) -> Principal | None:
        """The holder of a key that is still valid, by the key's id."""
        row = self.store.key_by_id(key_id)
        return holder(row) if row else None

    def list(self, who: Principal) -> list[KeyRecord]:
        require_admin(who)
        return self.store.list_keys()

    def revoke(self, who: Principal, key_id: str) -> None:
        require_admin(who)
        if not self.store.revoke_key(key_id):
            raise errors.NotFound(f"no key {key_id!r}")

    # -- the audit log of key use ---------------------------------------------------------

    def record_use(
        self, who: Principal, method: str, path: str, status: int, client: str | None, keep: int
    ) -> None:
        """One request made with `who`'s key (the newest `keep` are kept)."""
        if who.key_id is None:
            return
        use = KeyUse(
            key_id=who.key_id,
            tenant=who.tenant,
            at=now(),
            method=method,
            path=path,
            status=status,
            client=client,
        )
        self.store.add_key_uses([use], keep)

    def uses(self, key_id: str | None, tenant: str | None, limit: int) -> Sequence[KeyUse]:
        """The newest uses, newest first, of one key or one tenant's keys (or all)."""
        return self.store.key_uses(key_id, tenant, limit)


def holder(row: KeyRecord) -> Principal:
    """Whom a key speaks for: its tenant, its principal and roles."""
    roles = frozenset(Role(r) for r in row.roles)
    read_only = row.read_only or Role.viewer in roles
    return Principal(row.tenant, row.admin, read_only, row.id, row.principal or row.id, roles)


def require_write(who: Principal, method: str) -> None:
    """A read-only key may look (GET, HEAD), never change anything or run commands."""
    if who.read_only and method not in READS:
        raise errors.PermissionDenied(f"this key is read-only: {method} is not allowed")


READS = frozenset({"GET", "HEAD", "OPTIONS"})
READ_ONLY_HEADER = "x-cella-read-only"  # with X-Cella-Tenant: an admin key acts read-only
# with X-Cella-Tenant: an admin key acts as this principal with these roles (a fleet
# gateway relaying its caller, so the node applies the same access rule)
PRINCIPAL_HEADER = "x-cella-principal"
ROLES_HEADER = "x-cella-roles"


def require_admin(who: Principal, what: str = "manage keys") -> None:
    if not who.admin:
        raise errors.PermissionDenied(f"only an admin key can {what}")
