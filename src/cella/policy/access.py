"""Who may use a sandbox: the rule, pure.

A key belongs to a tenant and to a principal (the person or service holding it; by default
the key's own id), and has roles:

- `owner`: every sandbox of the tenant, with every permission (today's tenant keys);
- `member`: its principal's own sandboxes, those the tenant can see, those shared with it;
- `viewer`: reads only (GET and HEAD); beside `owner` it reads every sandbox, otherwise
  what a member would see.

A sandbox records its creator's principal, a visibility (`private`: its creator, the
tenant's owners and whom it is shared with; `tenant`: every key of the tenant may also
exec in it) and shares: principal -> `view` (look: inspect, trace, read files), `exec`
(also run commands, write files, open ports, snapshot and fork) or `manage` (also stop,
resume, delete, change its network and who may use it). A creator manages its own.

`permission` answers what a caller may do with one sandbox (None: it may not even know it
exists); the rooms of the service ask it through `Registry.access`, one place.

Names (the LangSmith API addresses sandboxes by name) are unique among one creator's
sandboxes and among those the whole tenant sees (`names_clash`): a private sandbox of
another principal never stands in the way of a name, or a refusal would tell that it
exists. A caller who sees several sandboxes of one name means its own, else the one the
tenant sees, else the only other it may see (`meant`)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
from typing import Literal

PRINCIPAL = r"^[A-Za-z0-9][A-Za-z0-9._@+:-]{0,127}$"
Visibility = Literal["private", "tenant"]


class Role(StrEnum):
    owner = "owner"
    member = "member"
    viewer = "viewer"


class Permission(IntEnum):
    """Each includes the ones below it."""

    view = 1
    exec = 2
    manage = 3


TENANT_WIDE = frozenset({Role.owner})


@dataclass(frozen=True, slots=True)
class Principal:
    """The caller of a request: a key (or whom a delegation token or console session
    speaks for), or the service itself (`key_id` None: e.g. an admin key acting for a
    tenant)."""

    tenant: str
    admin: bool
    read_only: bool = False  # GET and HEAD only
    key_id: str | None = None  # None: a principal derived from another (X-Cella-Tenant)
    name: str = ""  # the principal; "" with no key: the tenant itself
    roles: frozenset[Role] = TENANT_WIDE

    @classmethod
    def service(cls, tenant: str) -> Principal:
        """The service itself acting for a tenant (its reaper, builds, download links)."""
        return cls(tenant, admin=False)

    @property
    def wide(self) -> bool:
        """Sees and manages every sandbox of its tenant."""
        return Role.owner in self.roles

    @property
    def principal(self) -> str:
        return self.name or self.key_id or ""


@dataclass(frozen=True, slots=True)
class Access:
    """A sandbox as the rule sees it."""

    tenant: str
    creator: str | None  # its creator's principal (None: made before sandboxes had one)
    visibility: Visibility = "tenant"
    shares: Mapping[str, Permission] = field(default_factory=dict)


def permission(who: Principal, box: Access) -> Permission | None:
    """What `who` may do with the sandbox, or None if it may not see it."""
    if who.tenant != box.tenant:
        return None
    level: Permission | None
    if who.wide or (box.creator is not None and who.principal == box.creator):
        level = Permission.manage
    else:
        given = [box.shares.get(who.principal)]
        if box.visibility == "tenant":
            given.append(Permission.exec)
        level = max((p for p in given if p is not None), default=None)
    if level is not None and who.read_only:
        return Permission.view
    return level


def default_visibility(who: Principal) -> Visibility:
    """A sandbox made by a tenant-wide key is the tenant's (as every sandbox was before
    keys had roles); one made by a member's key is its own until shared."""
    return "tenant" if who.wide else "private"


def roles_of(given: list[Role] | None, read_only: bool) -> frozenset[Role]:
    """A key's roles: `owner` unless told (today's tenant keys), `viewer` with
    `read_only`; exactly one of `owner` and `member` besides `viewer`, or `viewer` alone."""
    roles = set(given) if given else {Role.owner}
    if read_only:
        roles.add(Role.viewer)
    if {Role.owner, Role.member} <= roles:
        raise ValueError("a key is an owner or a member of its tenant, not both")
    return frozenset(roles)


def valid_principal(name: str) -> bool:
    return re.fullmatch(PRINCIPAL, name) is not None


def names_clash(creator: str | None, other: Access) -> bool:
    """Whether a sandbox of `creator` (one being made or renamed, or made visible to the
    tenant) may not have the name `other` has: `other` is the same creator's, or every key
    of the tenant sees it. A private sandbox of someone else never clashes (whoever asks
    may not know it exists)."""
    return other.visibility == "tenant" or other.creator == creator


def meant(who: Principal, named: Sequence[Access]) -> list[int]:
    """Which of the sandboxes of one name (`named`) `who` means: the indices of the best
    ones it may see. Its own first (at most one: `names_clash`), else the one the tenant
    sees (at most one), else those it may see otherwise (shared with it, or every sandbox
    for an owner): one is meant; several are ambiguous; none, no sandbox of that name."""
    mine = who.principal or None
    seen = [i for i, box in enumerate(named) if permission(who, box) is not None]
    for rank in (
        [i for i in seen if named[i].creator == mine],
        [i for i in seen if named[i].visibility == "tenant"],
    ):
        if rank:
            return rank
    return seen
