"""Bucket mounts: an S3 or GCS bucket (or a prefix of it) mounted as a file system in the
guest, whose requests leave through the egress proxy like any other: the proxy signs them
(S3) or adds a bearer token (GCS) with the tenant's secrets the mount's `auth` names, so
the guest holds no key."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from datetime import datetime
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, Field, field_validator, model_validator

from cella.models.mounts import MOUNT_ID, mount_path
from cella.models.network import AWS_NAME, SECRET_NAME, AwsSigning, GcpToken, NetworkPolicy

BUCKET = r"^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$"  # S3's and GCS's names, together
S3_ENDPOINT = "https://s3.amazonaws.com"
S3_REGION = "us-east-1"
GCS_HOST = "storage.googleapis.com"  # its JSON API (uploads too, under /upload)
GCS_SCOPE = "https://www.googleapis.com/auth/devstorage."  # + read_only / read_write
S3_ONLY = ("endpoint_url", "region", "path_style", "kms_key")
AWS_FIELDS = ("access_key_id", "secret_access_key", "session_token")


class BucketCache(BaseModel):
    """The mount's local cache in the guest (rclone's VFS cache, on the sandbox's disk)."""

    model_config = {"extra": "forbid", "from_attributes": True}

    max_size_bytes: int | None = Field(
        default=None, ge=1 << 20, le=1 << 40, description="the cache's bound (none: unbounded)"
    )
    writeback_seconds: int | None = Field(
        default=None, ge=0, le=86400, description="a closed file is uploaded after this (5)"
    )


class BucketAuth(BaseModel):
    """The tenant's secrets the egress proxy authenticates the mount's requests with: for
    S3, an access key (`access_key_id`, `secret_access_key`, maybe `session_token`); for
    GCS, a service account's JSON key (`service_account`). None given: the requests go as
    the guest sends them, under the sandbox's own rules (its `aws`/`gcp` rules, or none for
    a public bucket)."""

    model_config = {"extra": "forbid", "from_attributes": True}

    access_key_id: str | None = Field(default=None, pattern=SECRET_NAME)
    secret_access_key: str | None = Field(default=None, pattern=SECRET_NAME)
    session_token: str | None = Field(default=None, pattern=SECRET_NAME)
    service_account: str | None = Field(default=None, pattern=SECRET_NAME)


class BucketMount(BaseModel):
    """A bucket mounted at `path` with rclone in the guest (`type` s3 or gcs): what it holds
    under `prefix` is the mount's tree; `read_only` refuses writes (EROFS); written files are
    uploaded `cache.writeback_seconds` after they are closed. S3 only: `endpoint_url`,
    `region`, `path_style` (else the bucket is in the host name) and `kms_key` (uploads use
    SSE-KMS with it). The mount's hosts are allowed for the sandbox."""

    model_config = {"extra": "forbid", "from_attributes": True}

    id: str = Field(pattern=MOUNT_ID)
    type: Literal["s3", "gcs"]
    path: str = Field(min_length=2, max_length=4096, description="absolute path in the guest")
    bucket: str = Field(pattern=BUCKET)
    prefix: str | None = Field(default=None, min_length=1, max_length=1024)
    read_only: bool = False
    cache: BucketCache = Field(default_factory=BucketCache)
    endpoint_url: str | None = Field(default=None, max_length=2048, description="s3 only")
    region: str | None = Field(default=None, pattern=AWS_NAME, description="s3 only")
    path_style: bool | None = Field(default=None, description="s3 only (default false)")
    kms_key: str | None = Field(
        default=None, min_length=1, max_length=2048, description="s3 only: SSE-KMS key ARN"
    )
    auth: BucketAuth | None = None

    _path = field_validator("path")(mount_path)

    @field_validator("prefix")
    @classmethod
    def _prefix(cls, value: str | None) -> str | None:
        if value is None:
            return None
        cleaned = value.strip("/")
        parts = cleaned.split("/")
        if not cleaned or any(c in value for c in "\x00\r\n") or ".." in parts or "" in parts:
            raise ValueError(f"prefix must be a relative key path, without '..': {value!r}")
        return cleaned

    @field_validator("endpoint_url")
    @classmethod
    def _endpoint(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parts = urlsplit(value)
        if any(c.isspace() or c == "\x00" for c in value) or parts.scheme != "https":
            raise ValueError("endpoint_url must be an https:// URL")
        if not parts.hostname or parts.username or parts.password:
            raise ValueError("endpoint_url must name a host, without credentials")
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise ValueError("endpoint_url is a host (and port), without a path")
        return f"https://{parts.netloc}"

    @field_validator("kms_key")
    @classmethod
    def _kms_key(cls, value: str | None) -> str | None:
        if value is not None and (any(c.isspace() for c in value) or value.startswith("-")):
            raise ValueError(f"invalid kms_key {value!r}")
        return value

    @model_validator(mode="after")
    def _kind(self) -> BucketMount:
        if self.type == "gcs":
            given = [f for f in S3_ONLY if getattr(self, f) is not None]
            if given:
                raise ValueError(f"{', '.join(given)}: s3 mounts only, not gcs")
        if self.auth is not None:
            aws = [f for f in AWS_FIELDS if getattr(self.auth, f) is not None]
            if self.type == "gcs" and (aws or not self.auth.service_account):
                raise ValueError("a gcs mount's auth is a service_account secret")
            if self.type == "s3" and (
                self.auth.service_account
                or not self.auth.access_key_id
                or not self.auth.secret_access_key
            ):
                raise ValueError("an s3 mount's auth is access_key_id and secret_access_key")
        return self

    # -- what it reaches, and how ----------------------------------------------------------

    @property
    def endpoint(self) -> str:
        if self.type == "gcs":
            return f"https://{GCS_HOST}"
        return self.endpoint_url or S3_ENDPOINT

    @property
    def hosts(self) -> list[str]:
        """The host names its requests go to: the endpoint's, and for a virtual-hosted S3
        bucket the bucket's name under it."""
        host = urlsplit(self.endpoint).hostname or ""
        if self.type == "s3" and not self.path_style:
            return [f"{self.bucket}.{host}", host]
        return [host]

    @property
    def secrets(self) -> list[str]:
        if self.auth is None:
            return []
        names = [getattr(self.auth, f) for f in (*AWS_FIELDS, "service_account")]
        return [n for n in names if n]

    def aws_rule(self) -> AwsSigning | None:
        """The proxy's signing rule for this mount's hosts (s3 with auth)."""
        if self.type != "s3" or self.auth is None:
            return None
        assert self.auth.access_key_id and self.auth.secret_access_key
        return AwsSigning.model_construct(
            hosts=self.hosts,
            access_key_id=self.auth.access_key_id,
            secret_access_key=self.auth.secret_access_key,
            session_token=self.auth.session_token,
            region=self.region or S3_REGION,
            service="s3",
        )

    def gcp_rule(self) -> GcpToken | None:
        """The proxy's token rule for this mount's host (gcs with auth): read-only tokens
        for a read-only mount."""
        if self.type != "gcs" or self.auth is None or not self.auth.service_account:
            return None
        scope = GCS_SCOPE + ("read_only" if self.read_only else "read_write")
        return GcpToken.model_construct(
            hosts=self.hosts, service_account=self.auth.service_account, scopes=[scope]
        )


class BucketState(BaseModel):
    """Where a bucket mount is: `mounting`, `mounted` (rclone serves it), `failed` (`error`
    says why; the next start of the VM, a resume or a fork, tries again) or `unmounted`
    (the sandbox's VM is not running)."""

    model_config = {"from_attributes": True}

    state: Literal["mounting", "mounted", "failed", "unmounted"]
    error: str | None = None
    at: datetime = Field(description="since when")


def check_bucket_auth(mounts: Sequence[BucketMount]) -> None:
    """The proxy picks credentials by host: two mounts that reach one host with different
    credentials cannot both be served."""
    for a, b in itertools.combinations(mounts, 2):
        shared = set(a.hosts) & set(b.hosts)
        if shared and a.auth and b.auth and a.auth != b.auth:
            raise ValueError(
                f"bucket mounts {a.id!r} and {b.id!r} reach {sorted(shared)[0]} with "
                "different auth (the proxy authenticates by host: give them the same)"
            )


def with_buckets(policy: NetworkPolicy, mounts: Sequence[BucketMount]) -> NetworkPolicy:
    """A sandbox's egress rules with its bucket mounts': their hosts allowed, and their
    signing and token rules ahead of the sandbox's own (a mount's keys win for its hosts).
    Mounts sharing a service account share one token rule, with the scopes of both."""
    if not mounts:
        return policy
    hosts = [h for m in mounts for h in m.hosts if h not in policy.allow]
    aws = [signing for m in mounts if (signing := m.aws_rule()) is not None]
    tokens: dict[str, GcpToken] = {}
    for m in mounts:
        token = m.gcp_rule()
        if token is None:
            continue
        had = tokens.get(token.service_account)
        if had is not None:
            scopes = sorted({*had.scopes, *token.scopes})
            token = had.model_copy(update={"scopes": scopes, "hosts": [*had.hosts, *token.hosts]})
        tokens[token.service_account] = token
    return policy.model_copy(
        update={
            "allow": [*policy.allow, *dict.fromkeys(hosts)],
            "aws": [*aws, *policy.aws],
            "gcp": [*tokens.values(), *policy.gcp],
        }
    )
