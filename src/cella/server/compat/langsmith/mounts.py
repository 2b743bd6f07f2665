"""LangSmith's `mount_config` as cella's mounts.

A `git` mount is a cella git mount: cloned into `mount_path` at create, through the
sandbox's egress (a private repository is reached with a `proxy_config` header rule for its
host, whose secret the guest never sees), and fetched and reset to its ref every
`refresh_interval_seconds`. What cella cannot do is refused by name, never ignored:
`contexthub` (cella has no Context Hub), and `s3` / `gcs` with their `auth` (a bucket mount
needs a FUSE client, such as rclone, in the guest image, which cella's templates do not
carry)."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from cella import errors
from cella.models import MAX_MOUNTS, GitMount
from cella.models.mounts import check_mounts
from cella.server.compat.langsmith.shapes import not_supported
from cella.server.error_shapes import describe

REFUSED = {
    "contexthub": "cella has no Context Hub",
    "s3": "bucket mounts need a FUSE client (rclone) in the guest image; "
    "cella's templates do not carry one",
    "gcs": "bucket mounts need a FUSE client (rclone) in the guest image; "
    "cella's templates do not carry one",
}


def mounts_of(config: Any) -> list[GitMount]:
    """The git mounts of a `mount_config`; every other kind is refused by name."""
    if not isinstance(config, dict) or not isinstance(config.get("mounts"), list):
        raise errors.InvalidArgument("mount_config: must be an object with a list of mounts")
    unknown = set(config) - {"mounts", "auth"}
    if unknown:
        raise not_supported(f"mount_config fields {sorted(unknown)}")
    specs = config["mounts"]
    if len(specs) > MAX_MOUNTS:
        raise errors.InvalidArgument(f"mount_config: at most {MAX_MOUNTS} mounts")
    mounts = []
    for spec in specs:
        if not isinstance(spec, dict):
            raise errors.InvalidArgument("mount_config: a mount is an object")
        kind, ident = spec.get("type"), spec.get("id", "?")
        if kind in REFUSED:
            raise not_supported(f"{kind} mount {ident!r} ({REFUSED[kind]})")
        if kind != "git":
            raise errors.InvalidArgument(f"mount_config: unknown mount type {kind!r}")
        mounts.append(git_mount(spec))
    if config.get("auth"):  # aws / gcp blocks belong to bucket mounts, refused above
        raise not_supported(f"mount_config auth {sorted(config['auth'])}")
    try:
        return check_mounts(mounts)
    except ValueError as exc:
        raise errors.InvalidArgument(f"mount_config: {exc}") from None


def git_mount(spec: dict[str, Any]) -> GitMount:
    git: dict[str, Any] = spec["git"] if isinstance(spec.get("git"), dict) else {}
    extra = set(spec) - {"id", "type", "mount_path", "git"}
    extra |= set(git) - {"remote_url", "ref", "refresh_interval_seconds"}
    if extra:
        raise not_supported(f"git mount fields {sorted(extra)}")
    try:
        return GitMount.model_validate(
            {
                "id": spec.get("id"),
                "path": spec.get("mount_path"),
                "url": git.get("remote_url"),
                "ref": git.get("ref"),
                "refresh_interval_seconds": git.get("refresh_interval_seconds"),
            }
        )
    except ValidationError as exc:
        where = f"mount_config: git mount {spec.get('id', '?')!r}"
        raise errors.InvalidArgument(f"{where}: {describe(exc.errors())}") from None
