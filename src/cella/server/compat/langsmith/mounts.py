"""LangSmith's `mount_config` as cella's mounts.

A `git` mount is a cella git mount: cloned into `mount_path` at create, through the
sandbox's egress (a private repository is reached with a `proxy_config` header rule for its
host, whose secret the guest never sees), and fetched and reset to its ref every
`refresh_interval_seconds`. An `s3` or `gcs` mount is a cella bucket mount (rclone in the
guest, through the egress proxy): `auth`'s `aws` static keys or `gcp` service account
(workspace secrets, or opaque values kept as the tenant's secrets) become the mounts'
`auth`, which the proxy signs or adds tokens with; an s3 mount without them uses the
sandbox's `proxy_config` aws rule. What cella cannot do is refused by name, never ignored:
`contexthub` (cella has no Context Hub) and an aws `role_arn` (no identity to assume it
with)."""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from cella import errors
from cella.models import MAX_MOUNTS, BucketMount, GitMount
from cella.models.buckets import check_bucket_auth
from cella.models.mounts import check_mounts
from cella.policy.cloud import service_account_problem
from cella.server.compat.langsmith.shapes import not_supported
from cella.server.error_shapes import describe

Json = dict[str, Any]
BUCKET_FIELDS = {"id", "type", "mount_path", "read_only", "cache"}
S3_FIELDS = {"endpoint_url", "region", "bucket", "prefix", "path_style"}
GCS_FIELDS = {"bucket", "prefix"}
Secret = tuple[str, Json]  # (field, the SDK's secret): named by the caller once all is valid


def mounts_of(config: Any) -> tuple[list[GitMount], list[BucketMount], dict[str, Secret]]:
    """The git and bucket mounts of a `mount_config`, and its auth's secrets by the name
    each bucket mount's auth gives them (`aws:access_key_id`, ...): the caller makes them
    tenant secrets (`control.bucket_auth`)."""
    if not config:
        return [], [], {}
    if not isinstance(config, dict) or not isinstance(config.get("mounts"), list):
        raise errors.InvalidArgument("mount_config: must be an object with a list of mounts")
    unknown = set(config) - {"mounts", "auth"}
    if unknown:
        raise not_supported(f"mount_config fields {sorted(unknown)}")
    specs = config["mounts"]
    if len(specs) > MAX_MOUNTS:
        raise errors.InvalidArgument(f"mount_config: at most {MAX_MOUNTS} mounts")
    auth = auth_of(config.get("auth") or {})
    git: list[GitMount] = []
    buckets: list[BucketMount] = []
    for spec in specs:
        if not isinstance(spec, dict):
            raise errors.InvalidArgument("mount_config: a mount is an object")
        kind, ident = spec.get("type"), spec.get("id", "?")
        if kind == "contexthub":
            raise not_supported(f"contexthub mount {ident!r} (cella has no Context Hub)")
        if kind == "git":
            git.append(git_mount(spec))
        elif kind in ("s3", "gcs"):
            buckets.append(bucket_mount(spec, auth))
        else:
            raise errors.InvalidArgument(f"mount_config: unknown mount type {kind!r}")
    kinds = {m.type for m in buckets}
    for provider, kind in (("aws", "s3"), ("gcp", "gcs")):
        if any(name.startswith(f"{provider}:") for name in auth) and kind not in kinds:
            raise errors.InvalidArgument(f"mount_config: {provider} auth without a {kind} mount")
    if "gcs" in kinds and "gcp:service_account_json" not in auth:
        raise errors.InvalidArgument("mount_config: gcs mounts require gcp auth")
    try:
        both: list[GitMount | BucketMount] = [*git, *buckets]
        check_mounts(both)
        check_bucket_auth(buckets)
    except ValueError as exc:
        raise errors.InvalidArgument(f"mount_config: {exc}") from None
    return git, buckets, auth


def auth_of(auth: Any) -> dict[str, Secret]:
    """`auth` as the SDK sends it (`{"aws": {...}, "gcp": {...}}`; a list of blocks too)."""
    if isinstance(auth, list):  # the blocks, as given to the SDK's helper
        auth = {b.get("type"): b.get(b.get("type")) for b in auth if isinstance(b, dict)}
    if not isinstance(auth, dict):
        raise errors.InvalidArgument("mount_config auth: an object of provider blocks")
    extra = set(auth) - {"aws", "gcp"}
    if extra:
        raise not_supported(f"mount_config auth {sorted(extra)}")
    out: dict[str, Secret] = {}
    aws, gcp = auth.get("aws"), auth.get("gcp")
    if aws is not None:
        if not isinstance(aws, dict):
            raise errors.InvalidArgument("mount_config auth aws: an object")
        if aws.get("role_arn"):
            raise not_supported(
                "mount_config auth aws role_arn (STS AssumeRole with LangSmith's workspace "
                "External ID); cella has no such identity: give access_key_id and "
                "secret_access_key"
            )
        if set(aws) - {"access_key_id", "secret_access_key", "role_arn"}:
            raise not_supported(f"mount_config auth aws fields {sorted(aws)}")
        for field in ("access_key_id", "secret_access_key"):
            out[f"aws:{field}"] = (field, secret(aws.get(field), field))
    if gcp is not None:
        if not isinstance(gcp, dict) or set(gcp) - {"service_account_json"}:
            raise not_supported(f"mount_config auth gcp fields {sorted(gcp or {})}")
        given = secret(gcp.get("service_account_json"), "service_account_json")
        if given["type"] == "opaque":
            why = service_account_problem(str(given["value"]))
            if why is not None:
                raise errors.InvalidArgument(f"mount_config auth gcp service_account_json: {why}")
            given = {**given, "value": json.dumps(json.loads(given["value"]))}  # one line
        out["gcp:service_account_json"] = ("service_account_json", given)
    return out


def secret(given: Any, field: str) -> Json:
    if not isinstance(given, dict) or given.get("type") not in ("workspace_secret", "opaque"):
        raise errors.InvalidArgument(
            f"mount_config auth {field} must be a workspace_secret or opaque value"
        )
    if not isinstance(given.get("value"), str) or not given["value"].strip():
        raise errors.InvalidArgument(f"mount_config auth {field}: an empty value")
    return given


def bucket_mount(spec: Json, auth: dict[str, Secret]) -> BucketMount:
    kind, ident = spec["type"], spec.get("id", "?")
    block: Json = spec[kind] if isinstance(spec.get(kind), dict) else {}
    extra = set(spec) - BUCKET_FIELDS - {kind, "encryption" if kind == "s3" else kind}
    extra |= set(block) - (S3_FIELDS if kind == "s3" else GCS_FIELDS)
    cache = spec.get("cache") or {}
    if isinstance(cache, dict):
        extra |= {f"cache.{k}" for k in set(cache) - {"max_size_bytes", "writeback_seconds"}}
    encryption = spec.get("encryption")
    if isinstance(encryption, dict):
        extra |= {f"encryption.{k}" for k in set(encryption) - {"kms_key"}}
    if extra:
        raise not_supported(f"{kind} mount {ident!r} fields {sorted(extra)}")
    fields: Json = {
        "id": spec.get("id"),
        "type": kind,
        "path": spec.get("mount_path"),
        "bucket": block.get("bucket"),
        "prefix": block.get("prefix"),
        "read_only": bool(spec.get("read_only") or False),
        "cache": cache,
    }
    if kind == "s3":
        fields |= {
            "endpoint_url": block.get("endpoint_url"),
            "region": block.get("region"),
            "path_style": block.get("path_style"),
            "kms_key": (encryption or {}).get("kms_key") if isinstance(encryption, dict) else None,
        }
        if "aws:access_key_id" in auth:  # placeholders: control.bucket_auth names the secrets
            fields["auth"] = {"access_key_id": "aws-key-id", "secret_access_key": "aws-secret"}
    elif "gcp:service_account_json" in auth:
        fields["auth"] = {"service_account": "gcp-service-account"}
    try:
        return BucketMount.model_validate(fields)
    except ValidationError as exc:
        where = f"mount_config: {kind} mount {ident!r}"
        raise errors.InvalidArgument(f"{where}: {describe(exc.errors())}") from None


def git_mount(spec: Json) -> GitMount:
    git: Json = spec["git"] if isinstance(spec.get("git"), dict) else {}
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
