"""Git mounts as cella's create takes them, and LangSmith's mount_config read into them."""

from __future__ import annotations

import pytest
from langsmith.sandbox import context_hub_mount, gcs_mount, git_mount, mount_config, s3_mount
from pydantic import ValidationError

from cella import errors
from cella.models import MAX_MOUNTS, GitMount, SandboxCreate
from cella.server.compat.langsmith.create import read_create
from cella.server.compat.langsmith.mounts import mounts_of

URL = "https://git.example/org/repo.git"


def test_a_git_mount_is_held_to_its_bounds() -> None:
    good = GitMount.model_validate(
        {"id": "m", "path": "/work/m/", "url": URL, "ref": {"type": "tag", "name": "v1.2"}}
    )
    assert good.path == "/work/m" and good.ref is not None
    assert good.ref.refspec == "refs/tags/v1.2"
    bad = [
        {"path": "work"},  # relative
        {"path": "/a/../b"},
        {"path": "/"},
        {"url": "https://user:pw@git.example/r.git"},  # credentials belong in a header rule
        {"url": "ssh://git.example/r.git"},
        {"url": "https://git.example/"},
        {"url": URL + "?x=1"},
        {"ref": {"type": "branch", "name": "-u"}},  # never an option on git's argv
        {"ref": {"type": "branch", "name": "a/../b"}},
        {"ref": {"type": "commit", "name": "abc"}},
        {"id": "has space"},
        {"refresh_interval_seconds": 0},
    ]
    for change in bad:
        with pytest.raises(ValidationError):
            GitMount.model_validate({"id": "m", "path": "/w", "url": URL, **change})


def test_a_create_bounds_its_mounts_and_keeps_them_apart() -> None:
    one = {"id": "a", "path": "/w/a", "url": URL}
    assert len(SandboxCreate(mounts=[one]).mounts) == 1  # type: ignore[list-item]
    many = [{**one, "id": f"m{i}", "path": f"/w/{i}"} for i in range(MAX_MOUNTS + 1)]
    for mounts in (many, [one, one], [one, {**one, "id": "b", "path": "/w/a/in"}]):
        with pytest.raises(ValidationError):
            SandboxCreate(mounts=mounts)  # type: ignore[arg-type]


def test_langsmith_git_mounts_become_cella_mounts() -> None:
    config = mount_config(
        mounts=[
            git_mount(
                id="g",
                mount_path="/g",
                remote_url=URL,
                ref={"type": "branch", "name": "dev"},
                refresh_interval_seconds=30,
            )
        ]
    )
    [mount] = read_create({"mount_config": config}).spec().mounts
    assert (mount.id, mount.path, mount.url, mount.refresh_interval_seconds) == ("g", "/g", URL, 30)
    assert mount.ref is not None and (mount.ref.type, mount.ref.name) == ("branch", "dev")
    assert read_create({}).spec().mounts == []  # control: none given, none made


def test_langsmith_mounts_cella_cannot_serve_are_refused_by_name() -> None:
    secret = {"type": "opaque", "value": "x"}
    s3 = s3_mount(id="s", mount_path="/s", bucket="bkt")
    refused = {
        "contexthub mount 'h'": {"mounts": [context_hub_mount(id="h", mount_path="/h", repo="r")]},
        "role_arn": mount_config(
            mounts=[s3], auth=[{"type": "aws", "aws": {"role_arn": "arn:aws:iam::1:role/r"}}]
        ),
        "fields ['storage_class']": {
            "mounts": [{**s3, "s3": {**s3["s3"], "storage_class": "GLACIER"}}]
        },
    }
    for words, config in refused.items():
        with pytest.raises(errors.RequestError, match="not supported by cella") as caught:
            mounts_of(config)
        assert words in str(caught.value)
    # the control: s3 and gcs mounts are read, every field of them
    sa = {"type": "workspace_secret", "value": "{SA}"}
    config = mount_config(
        mounts=[
            s3_mount(
                id="s",
                mount_path="/s",
                bucket="bkt",
                prefix="p/",
                region="eu-west-1",
                endpoint_url="https://s3.eu-west-1.amazonaws.com",
                path_style=True,
                read_only=True,
                cache={"max_size_bytes": 1 << 30, "writeback_seconds": 9},
                encryption={"kms_key": "arn:aws:kms:eu-west-1:1:key/k"},
            ),
            gcs_mount(id="c", mount_path="/c", bucket="gbkt"),
        ],
        auth=[
            {"type": "aws", "aws": {"access_key_id": secret, "secret_access_key": secret}},
            {"type": "gcp", "gcp": {"service_account_json": sa}},
        ],
    )
    git, (s, c), auth = mounts_of(config)
    assert not git and set(auth) == {
        "aws:access_key_id", "aws:secret_access_key", "gcp:service_account_json"
    }  # fmt: skip
    assert (s.bucket, s.prefix, s.region, s.path_style, s.read_only) == (
        "bkt", "p", "eu-west-1", True, True
    )  # fmt: skip
    assert s.hosts == ["s3.eu-west-1.amazonaws.com"] and s.kms_key is not None
    assert (s.cache.max_size_bytes, s.cache.writeback_seconds) == (1 << 30, 9)
    assert (c.type, c.bucket, c.hosts, c.read_only) == (
        "gcs",
        "gbkt",
        ["storage.googleapis.com"],
        False,
    )
    with pytest.raises(errors.InvalidArgument, match="mount 'g'"):
        mounts_of(
            {
                "mounts": [
                    {"id": "g", "type": "git", "mount_path": "rel", "git": {"remote_url": URL}}
                ]
            }
        )
