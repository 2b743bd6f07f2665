"""Bucket mounts without a VM: what the model takes and refuses, the proxy rules a mount
adds to its sandbox's, and rclone's argv and environment (every field honoured)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from cella.models import BucketMount, GitMount, NetworkPolicy, SandboxCreate
from cella.models.buckets import with_buckets
from cella.policy.cloud import DUMMY_AWS_ENV
from cella.service.buckets import rclone_argv, rclone_env, remote

KEYS = {"access_key_id": "kid", "secret_access_key": "key"}


def s3(**fields: Any) -> BucketMount:
    return BucketMount.model_validate({"id": "b", "type": "s3", "path": "/b", "bucket": "bkt"}
                                      | fields)  # fmt: skip


def test_what_a_bucket_mount_refuses() -> None:
    bad: list[dict[str, Any]] = [
        {"type": "gcs", "region": "us-east-1"},  # s3 only
        {"type": "gcs", "path_style": True},
        {"auth": {"service_account": "sa"}},  # an s3 mount's auth is a key
        {"auth": {"access_key_id": "kid"}},  # both halves
        {"type": "gcs", "auth": KEYS},
        {"endpoint_url": "http://s3.test"},
        {"endpoint_url": "https://u:p@s3.test"},
        {"endpoint_url": "https://s3.test/path"},
        {"prefix": "a/../b"},
        {"prefix": "a//b"},
        {"bucket": "UPPER"},
        {"kms_key": "--s3-endpoint=x"},
        {"cache": {"max_size_bytes": 10}},
        {"unknown": 1},
    ]
    for fields in bad:
        with pytest.raises(ValidationError):
            s3(**fields)
    assert s3(prefix="/runs/").prefix == "runs"  # the control: slashes trimmed, taken


def test_mount_ids_and_paths_are_checked_with_git_mounts() -> None:
    git = GitMount(id="g", path="/w", url="https://pub.test/r.git")
    with pytest.raises(ValidationError, match="overlap"):
        SandboxCreate(mounts=[git], bucket_mounts=[s3(path="/w/data")])
    with pytest.raises(ValidationError, match="unique"):
        SandboxCreate(mounts=[git], bucket_mounts=[s3(id="g")])
    with pytest.raises(ValidationError, match="different auth"):
        other = {"access_key_id": "kid2", "secret_access_key": "key"}
        SandboxCreate(bucket_mounts=[s3(auth=KEYS), s3(id="c", path="/c", auth=other)])
    SandboxCreate(mounts=[git], bucket_mounts=[s3(auth=KEYS), s3(id="c", path="/c", auth=KEYS)])


def test_the_rules_a_mount_adds() -> None:
    own = NetworkPolicy(allow=["pypi.org"])
    vhost = s3(auth=KEYS, region="eu-west-1")
    path = s3(id="p", path="/p", endpoint_url="https://minio.test:9000", path_style=True)
    gro = BucketMount(id="g", type="gcs", path="/g", bucket="gbk", read_only=True,
                      auth={"service_account": "sa"})  # type: ignore[arg-type]  # fmt: skip
    grw = gro.model_copy(update={"id": "h", "path": "/h", "read_only": False})
    policy = with_buckets(own, [vhost, path, gro, grw])
    assert policy.allow == [
        "pypi.org", "bkt.s3.amazonaws.com", "s3.amazonaws.com", "minio.test",
        "storage.googleapis.com",
    ]  # fmt: skip
    [aws] = policy.aws  # the mount without auth adds none: the sandbox's rules apply
    assert aws.hosts == ["bkt.s3.amazonaws.com", "s3.amazonaws.com"] and aws.region == "eu-west-1"
    assert (aws.access_key_id, aws.secret_access_key) == ("kid", "key")
    [gcp] = policy.gcp  # one service account, one rule, the scopes of both mounts
    assert gcp.service_account == "sa" and [s.rsplit(".", 1)[1] for s in gcp.scopes] == [
        "read_only", "read_write"
    ]  # fmt: skip
    assert set(policy.secret_names) == {"kid", "key", "sa"}
    assert with_buckets(own, []) is own


def test_rclone_honours_every_field() -> None:
    mount = s3(prefix="runs", read_only=True, path_style=True, region="eu-west-1",
               endpoint_url="https://s3.eu-west-1.amazonaws.com", kms_key="arn:k",
               cache={"max_size_bytes": 1 << 30, "writeback_seconds": 9})  # fmt: skip
    argv, env = rclone_argv(mount), rclone_env(mount)
    assert remote(mount) == ":s3:bkt/runs" and argv[:4] == ["rclone", "mount", ":s3:bkt/runs", "/b"]
    assert "--read-only" in argv and "--allow-other" in argv
    assert argv[argv.index("--vfs-cache-max-size") + 1] == f"{1 << 30}B"
    assert argv[argv.index("--vfs-write-back") + 1] == "9s"
    assert env["RCLONE_S3_ENDPOINT"] == "https://s3.eu-west-1.amazonaws.com"
    assert env["RCLONE_S3_REGION"] == "eu-west-1" and env["RCLONE_S3_FORCE_PATH_STYLE"] == "true"
    assert env["RCLONE_S3_SSE_KMS_KEY_ID"] == "arn:k"
    assert env["RCLONE_S3_ACCESS_KEY_ID"] == DUMMY_AWS_ENV["AWS_ACCESS_KEY_ID"]
    plain = rclone_argv(s3())
    assert "--read-only" not in plain and "--vfs-write-back" not in plain  # the control
    assert rclone_env(s3())["RCLONE_S3_FORCE_PATH_STYLE"] == "false"
    gcs = BucketMount(id="g", type="gcs", path="/g", bucket="gbk")
    assert rclone_env(gcs)["RCLONE_GCS_ANONYMOUS"] == "true"
    assert not any(k.startswith("RCLONE_S3") for k in rclone_env(gcs))
