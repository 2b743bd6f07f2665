"""Image registries: a tenant's credentials for pulling its private images.

Each tenant's own (another tenant's registry is not found, by id or by name). The password
is sealed at rest with the secrets key (`store/sealing.py`), is never returned, and is
handed out only to pull an image whose reference names the registry's own host.
"""

from __future__ import annotations

import uuid

from cella import errors
from cella.models.registries import RegistryCreate, RegistryUpdate, registry_host
from cella.store import RegistryRecord, Store

MAX_PER_TENANT = 100


class ImageRegistries:
    def __init__(self, store: Store) -> None:
        self.store = store

    def create(self, tenant: str, req: RegistryCreate) -> RegistryRecord:
        _check_pair(req.username, req.password)
        if len(self.store.list_registries(tenant)) >= MAX_PER_TENANT:
            raise errors.QuotaExceeded(f"a tenant has at most {MAX_PER_TENANT} registries")
        record = RegistryRecord(
            id=str(uuid.uuid4()),
            tenant=tenant,
            name=req.name,
            url=req.url,
            username=req.username,
            password=req.password,
        )
        return self.store.put_registry(record)

    def list(self, tenant: str, name_contains: str | None = None) -> list[RegistryRecord]:
        rows = self.store.list_registries(tenant)
        if name_contains:
            rows = [r for r in rows if name_contains.lower() in r.name.lower()]
        return rows

    def get(self, tenant: str, key: str) -> RegistryRecord:
        """The tenant's registry by id or name."""
        row = self.store.get_registry(tenant, key)
        if row is None:
            raise errors.NotFound(f"no registry {key!r}")
        return row

    def update(self, tenant: str, key: str, change: RegistryUpdate) -> RegistryRecord:
        row = self.get(tenant, key)
        given = change.model_fields_set
        if {"username", "password"} & given:  # credentials are replaced as a pair
            _check_pair(change.username, change.password)
            row.username, row.password = change.username, change.password
        if change.name is not None:
            row.name = change.name
        if change.url is not None:
            row.url = change.url
        return self.store.put_registry(row)

    def delete(self, tenant: str, key: str) -> None:
        self.store.delete_registry(tenant, self.get(tenant, key).id)

    def credentials(self, tenant: str, key: str, image: str) -> str | None:
        """`user:password` for pulling `image` with the tenant's registry `key`; refused
        when the image names another host (credentials go to their own registry only)."""
        row = self.get(tenant, key)
        host = image_host(image)
        if host != row.url:
            raise errors.InvalidArgument(
                f"the image {image!r} is not on the registry {row.name!r} ({row.url})"
            )
        if row.username is None or row.password is None:
            return None
        return f"{row.username}:{row.password}"


def image_host(image: str) -> str:
    """The registry host an image reference names (`host[:port]/repo:tag`); Docker Hub's
    when the first part is not a host."""
    first, slash, _ = image.removeprefix("docker://").partition("/")
    if slash and ("." in first or ":" in first or first == "localhost"):
        try:
            return registry_host(first)
        except ValueError:
            raise errors.InvalidArgument(f"{image!r}: not an image reference") from None
    return "docker.io"


def _check_pair(username: str | None, password: str | None) -> None:
    if (username is None) != (password is None):
        raise errors.InvalidArgument("a registry's username and password are given together")
