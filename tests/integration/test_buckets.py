"""Bucket mounts end to end: real microVMs with rclone, the real daemon and egress proxy,
and real stores on loopback addresses under AWS's and Google's names (the operator's host
table maps them): moto's S3, which checks every Signature V4 against the keys its IAM
issued, Google's token endpoint stand-in (checks the service account's signed grant) and a
GCS JSON-API stand-in that serves only bearers of the tokens it issued. The guest's rclone
signs with dummy keys (S3) or not at all (GCS): the mounts work only because the proxy
authenticates them, and the guest's environment, files and processes never hold a key.
Driven through cella's SDK and the pinned LangSmith SDK (`mount_config`, `s3_mount`,
`gcs_mount`), sync and async."""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import boto3
import httpx
import jwt
import pytest
from botocore.client import Config
from botocore.exceptions import ClientError
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from langsmith.sandbox import (
    AsyncSandboxClient,
    SandboxClient,
    SandboxClientError,
    aws_auth,
    gcs_mount,
    mount_config,
    opaque_secret,
    proxy_config,
    s3_mount,
    workspace_secret,
)

from cella import Client, Sandbox, errors
from cella.models import BucketMount, GitMount
from tests.daemon import Daemon
from tests.integration.test_cloud_auth import TokenHandler
from tests.netservers import (
    GcsHandler,
    Recorder,
    Servers,
    TestCA,
    free_loopback_block,
    moto_key,
    start_moto,
)

pytestmark = pytest.mark.vm

S3_HOST = "s3.us-east-1.amazonaws.com"
BUCKET = "cella-data"
VHOST = f"{BUCKET}.{S3_HOST}"  # the SDK's default: the bucket in the host name
TOKEN_HOST = "oauth2.googleapis.com"
GCS_HOST = "storage.googleapis.com"
GCS_BUCKET = "cella-gcs"
EVERY_ENV = "env; cat /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n'; ps -eo args; true"
# every file a mount could have written its credentials to, read out and searched on the host
MOUNT_FILES = (
    "find /var/cache/cella-mounts /var/log/cella-mounts /root /tmp -type f -size -4M"
    " -print0 2>/dev/null | xargs -0 cat 2>/dev/null; true"
)


@dataclass
class Stores:
    ca: TestCA
    s3: str  # moto's address
    key_id: str
    secret_key: str
    service_account: str
    issued: list[str]
    gcs_seen: Recorder
    gcs_objects: dict[tuple[str, str], tuple[bytes, dict[str, Any]]]

    def s3_client(self, key_id: str | None = None, secret_key: str | None = None) -> Any:
        return boto3.client(
            "s3",
            endpoint_url=f"https://{self.s3}",
            region_name="us-east-1",
            aws_access_key_id=key_id or self.key_id,
            aws_secret_access_key=secret_key or self.secret_key,
            verify=str(self.ca.cert),
            config=Config(s3={"addressing_style": "path"}),
        )

    def no_keys_in(self, text: str) -> None:
        private_key = json.loads(self.service_account)["private_key"]
        assert self.secret_key not in text and self.key_id not in text
        assert private_key.splitlines()[1] not in text
        assert not any(token in text for token in self.issued)


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stores]:
    base = tmp_path_factory.mktemp("buckets")
    prefix = free_loopback_block()
    s3, token, gcs = f"{prefix}.4", f"{prefix}.5", f"{prefix}.6"
    ca = TestCA(base / "ca", [S3_HOST, VHOST, TOKEN_HOST, GCS_HOST, s3, token, gcs])
    moto = start_moto(s3, ca, base / "moto.log")
    servers = Servers()
    try:
        key = moto_key(s3, ca, "agent")
        private = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        pem = private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ).decode()
        public = private.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        email = "agent@cella-test.iam.gserviceaccount.com"
        account = {
            "type": "service_account", "project_id": "cella-test", "private_key_id": "k1",
            "private_key": pem, "client_email": email, "client_id": "1",
            "token_uri": f"https://{TOKEN_HOST}/token",
        }  # fmt: skip
        issued: list[str] = []
        # the token endpoint grants the storage scopes mounts ask for, read-only or not
        storage = "https://www.googleapis.com/auth/devstorage."
        ro, rw = storage + "read_only", storage + "read_write"
        grants = frozenset({ro, rw, f"{ro} {rw}"})
        servers.start(TokenHandler, (token, 443), ca.server_context(), public_key=public,
                      email=email, issued=issued, scopes=grants)  # fmt: skip
        objects = {
            (GCS_BUCKET, "seeded.txt"): (b"seeded in gcs", {}),
            (GCS_BUCKET, "team/a.txt"): (b"team a in gcs", {}),
        }
        gcs_seen = servers.start(
            GcsHandler, (gcs, 443), ca.server_context(), issued=issued, objects=objects
        )
        found = Stores(
            ca, s3, key["AccessKeyId"], key["SecretAccessKey"], json.dumps(account),
            issued, gcs_seen, objects,
        )  # fmt: skip
        store = found.s3_client()
        store.create_bucket(Bucket=BUCKET)
        store.put_object(Bucket=BUCKET, Key="seeded.txt", Body=b"seeded from the host")
        store.put_object(Bucket=BUCKET, Key="team/a.txt", Body=b"team a")
        yield found
    finally:
        servers.close()
        moto.kill()
        moto.wait()


@pytest.fixture(scope="module")
def daemon_settings(stores: Stores) -> dict[str, str]:
    prefix = stores.s3.rsplit(".", 1)[0]
    hosts = {S3_HOST: stores.s3, VHOST: stores.s3}
    hosts |= {TOKEN_HOST: f"{prefix}.5", GCS_HOST: f"{prefix}.6"}
    return {
        "pool_size": "0",
        "egress_hosts": json.dumps(hosts),
        "egress_upstream_ca": str(stores.ca.cert),
    }


@pytest.fixture(scope="module")
def keys(admin: Client, stores: Stores) -> None:
    admin.put_secret("s3-key-id", stores.key_id, [S3_HOST, VHOST])
    admin.put_secret("s3-secret", stores.secret_key, [S3_HOST, VHOST])
    admin.put_secret("gcs-sa", stores.service_account, [GCS_HOST])


def sh(sb: Sandbox, command: str) -> str:
    r = sb.exec(command, timeout=120)
    assert r.exit_code == 0, (command, r.stderr.decode())
    return r.stdout.decode()


def eventually(what: str, probe: Callable[[], bool], timeout: float = 120) -> None:
    """Polls `probe` until it is true; `timeout` only bounds a failing test."""
    deadline = time.monotonic() + timeout
    while not probe():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.5)


def s3_object(stores: Stores, key: str) -> bytes | None:
    try:
        return stores.s3_client().get_object(Bucket=BUCKET, Key=key)["Body"].read()  # type: ignore[no-any-return]
    except ClientError:
        return None


S3_AUTH = {"access_key_id": "s3-key-id", "secret_access_key": "s3-secret"}
KMS_KEY = "arn:aws:kms:us-east-1:123456789012:key/cella-test"


def test_s3_mounts_read_write_and_refuse_writes_when_read_only(
    admin: Client, stores: Stores, keys: None
) -> None:
    """cella's own API: a read-write mount of the whole bucket (path style, SSE-KMS, written
    back at once) and a read-only one of a prefix (the bucket in the host name, a bounded
    cache); through a stop, a resume and a fork."""
    rw = BucketMount.model_validate({
        "id": "data", "type": "s3", "path": "/mnt/data", "bucket": BUCKET,
        "endpoint_url": f"https://{S3_HOST}", "path_style": True, "kms_key": KMS_KEY,
        "cache": {"writeback_seconds": 0}, "auth": S3_AUTH,
    })  # fmt: skip
    ro = BucketMount.model_validate({
        "id": "team", "type": "s3", "path": "/mnt/team", "bucket": BUCKET, "prefix": "team",
        "endpoint_url": f"https://{S3_HOST}", "read_only": True,
        "cache": {"max_size_bytes": 64 << 20}, "auth": S3_AUTH,
    })  # fmt: skip
    with admin.create(bucket_mounts=[rw, ro]) as sb:
        states = admin.get(sb.id).info.mount_states
        assert {k: v.state for k, v in states.items()} == {"data": "mounted", "team": "mounted"}
        assert [m.id for m in sb.info.bucket_mounts] == ["data", "team"]
        # list and read; the prefix is all the read-only mount sees
        assert sh(sb, "ls /mnt/data").split() == ["seeded.txt", "team"]
        assert sh(sb, "cat /mnt/data/seeded.txt") == "seeded from the host"
        assert sh(sb, "ls /mnt/team").split() == ["a.txt"]
        assert sh(sb, "cat /mnt/team/a.txt") == "team a"
        # write: read-write lands in the bucket (encrypted with the key); read-only refuses
        sh(sb, "echo 'from the guest' > /mnt/data/team/new.txt")
        eventually("the write reached S3", lambda: s3_object(stores, "team/new.txt") is not None)
        assert s3_object(stores, "team/new.txt") == b"from the guest\n"
        head = stores.s3_client().head_object(Bucket=BUCKET, Key="team/new.txt")
        assert head["ServerSideEncryption"] == "aws:kms" and head["SSEKMSKeyId"] == KMS_KEY
        refused = sb.exec("echo nope > /mnt/team/b.txt", timeout=60)
        assert refused.exit_code != 0 and b"Read-only file system" in refused.stderr
        refused = sb.exec("rm /mnt/team/a.txt", timeout=60)
        assert refused.exit_code != 0 and b"Read-only file system" in refused.stderr
        sh(sb, "echo fine > /mnt/data/team/b.txt")  # the control: the same write, read-write
        eventually("b.txt reached S3", lambda: s3_object(stores, "team/b.txt") == b"fine\n")
        assert s3_object(stores, "team/a.txt") == b"team a"
        # the guest holds dummy keys, never the real ones (nor does its trace)
        env = sh(sb, EVERY_ENV)
        assert "rclone mount :s3:cella-data /mnt/data" in env  # the control: ps was read
        stores.no_keys_in(env + sh(sb, MOUNT_FILES))
        stores.no_keys_in(json.dumps([e.data for e in sb.events()]))
        # stopped: unmounted; resumed: mounted again, the data still there
        sb.stop()
        states = admin.get(sb.id).info.mount_states
        assert {v.state for v in states.values()} == {"unmounted"}
        sb.resume()
        eventually(
            "mounted again after the resume",
            lambda: {v.state for v in admin.get(sb.id).info.mount_states.values()} == {"mounted"},
        )
        assert sh(sb, "cat /mnt/data/team/new.txt /mnt/team/b.txt") == "from the guest\nfine\n"
        # a fork (restored with its memory) keeps its parent's rclone and serves the bucket
        [branch] = sb.fork()
        try:
            eventually(
                "the fork's mounts checked",
                lambda: len(branch.events(types=["bucket_mounted"])) >= 2,
            )
            assert all(e.data["kept"] for e in branch.events(types=["bucket_mounted"]))
            sh(branch, "echo forked > /mnt/data/forked.txt")
            eventually("the fork wrote", lambda: s3_object(stores, "forked.txt") == b"forked\n")
            assert sh(branch, "cat /mnt/team/a.txt") == "team a"
        finally:
            branch.delete()


def test_the_same_requests_from_the_host_are_refused(stores: Stores) -> None:
    """Without the proxy's credentials both stores refuse: unsigned S3, a GCS request with
    no bearer or a made-up one; with real credentials (the control) they answer."""
    trust = ssl.create_default_context(cafile=stores.ca.cert)
    url = f"https://{stores.s3}/{BUCKET}/seeded.txt"
    assert httpx.get(url, headers={"Host": S3_HOST}, verify=trust).status_code == 403
    assert s3_object(stores, "seeded.txt") == b"seeded from the host"
    prefix = stores.s3.rsplit(".", 1)[0]
    media = f"https://{prefix}.6/storage/v1/b/{GCS_BUCKET}/o/seeded.txt?alt=media"
    assert httpx.get(media, headers={"Host": GCS_HOST}, verify=trust).status_code == 401
    made_up = {"Host": GCS_HOST, "Authorization": "Bearer ya29.made-up"}
    assert httpx.get(media, headers=made_up, verify=trust).status_code == 401
    # the control: a token the endpoint grants for the service account's own signed grant
    account = json.loads(stores.service_account)
    now = int(time.time())
    scope = "https://www.googleapis.com/auth/devstorage.read_only"
    claims = {"iss": account["client_email"], "aud": account["token_uri"], "iat": now,
              "exp": now + 600, "scope": scope}  # fmt: skip
    form = {"grant_type": "urn:ietf:params:oauth:grant-type:jwt-bearer",
            "assertion": jwt.encode(claims, account["private_key"], algorithm="RS256")}  # fmt: skip
    granted = httpx.post(f"https://{prefix}.5/token", data=form,
                         headers={"Host": TOKEN_HOST}, verify=trust)  # fmt: skip
    good = {"Host": GCS_HOST, "Authorization": f"Bearer {granted.json()['access_token']}"}
    assert httpx.get(media, headers=good, verify=trust).content == b"seeded in gcs"


def test_gcs_mounts_with_a_service_account(admin: Client, stores: Stores, keys: None) -> None:
    """A read-write GCS mount and a read-only one of a prefix: every request the store saw
    carried a token the proxy minted from the service account."""
    rw = BucketMount(id="g", type="gcs", path="/mnt/g", bucket=GCS_BUCKET,
                     auth={"service_account": "gcs-sa"}, cache={"writeback_seconds": 0})  # type: ignore[arg-type]  # fmt: skip
    ro = BucketMount(id="gt", type="gcs", path="/mnt/gt", bucket=GCS_BUCKET, prefix="team",
                     read_only=True, auth={"service_account": "gcs-sa"})  # type: ignore[arg-type]  # fmt: skip
    before = len(stores.gcs_seen.requests)
    with admin.create(bucket_mounts=[rw, ro]) as sb:
        assert sh(sb, "ls /mnt/g").split() == ["seeded.txt", "team"]
        assert sh(sb, "cat /mnt/g/seeded.txt") == "seeded in gcs"
        assert sh(sb, "ls /mnt/gt").split() == ["a.txt"]
        sh(sb, "echo 'to gcs' > /mnt/g/team/up.txt")
        eventually(
            "the upload reached the store",
            lambda: (GCS_BUCKET, "team/up.txt") in stores.gcs_objects,
        )
        assert stores.gcs_objects[(GCS_BUCKET, "team/up.txt")][0] == b"to gcs\n"
        refused = sb.exec("echo nope > /mnt/gt/b.txt", timeout=60)
        assert refused.exit_code != 0 and b"Read-only file system" in refused.stderr
        stores.no_keys_in(sh(sb, EVERY_ENV) + sh(sb, MOUNT_FILES))
    seen = stores.gcs_seen.requests[before:]
    assert seen and all(r["ok"] for r in seen), [r for r in seen if not r["ok"]]
    assert any(r["method"] == "POST" and "/upload/" in r["path"] for r in seen)


def test_bad_bucket_mounts_are_refused_before_anything_starts(
    admin: Client, stores: Stores, keys: None
) -> None:
    base = {"id": "b", "type": "s3", "path": "/mnt/b", "bucket": BUCKET}
    bodies: list[dict[str, Any]] = [
        {**base, "type": "gcs", "endpoint_url": "https://x.test"},  # s3 only
        {**base, "auth": {"service_account": "gcs-sa"}},  # an s3 mount's auth is a key
        {**base, "endpoint_url": "http://s3.test"},  # https only
        {**base, "prefix": "../up"},
        {**base, "path": "relative"},
        {**base, "auth": {"access_key_id": "nope", "secret_access_key": "s3-secret"}},
    ]
    before = len(admin.list())
    for body in bodies:
        with pytest.raises(errors.InvalidArgument):
            admin.request("POST", "/v1/sandboxes", json={"bucket_mounts": [body]})
    git = GitMount(id="g", path="/mnt", url="https://pub.test/r.git")
    with pytest.raises(errors.InvalidArgument, match="overlap"):
        admin.request(
            "POST",
            "/v1/sandboxes",
            json={"mounts": [git.model_dump()], "bucket_mounts": [base]},
        )
    assert len(admin.list()) == before  # nothing was started
    # a bucket that does not exist: the create fails naming the mount
    missing = BucketMount(id="nosuch", type="s3", path="/mnt/x", bucket="no-such-bucket",
                          endpoint_url=f"https://{S3_HOST}", path_style=True, auth=S3_AUTH)  # type: ignore[arg-type]  # fmt: skip
    with pytest.raises(errors.InvalidArgument, match="mount 'nosuch'"):
        admin.create(bucket_mounts=[missing])


@pytest.fixture(scope="module")
def ls(daemon: Daemon) -> Iterator[SandboxClient]:
    c = SandboxClient(api_endpoint=f"{daemon.url}/api/v2/sandboxes", api_key=daemon.admin_key)
    yield c
    c.close()


def test_langsmith_s3_mounts(ls: SandboxClient, stores: Stores, admin: Client) -> None:
    """LangSmith's `mount_config`: s3 mounts (the SDK's defaults: the bucket in the host
    name) with opaque keys in its auth; read_only and prefix honoured."""
    config = mount_config(
        mounts=[
            s3_mount(
                id="all",
                mount_path="/data",
                bucket=BUCKET,
                endpoint_url=f"https://{S3_HOST}",
                cache={"writeback_seconds": 0},
            ),
            s3_mount(
                id="team",
                mount_path="/team",
                bucket=BUCKET,
                prefix="team",
                endpoint_url=f"https://{S3_HOST}",
                read_only=True,
            ),
        ],
        auth=[
            {
                "type": "aws",
                "aws": {
                    "access_key_id": opaque_secret(stores.key_id),
                    "secret_access_key": opaque_secret(stores.secret_key),
                },
            }
        ],
    )
    with ls.sandbox(name="ls-buckets", mount_config=config) as box:
        assert box.run("cat /data/seeded.txt").stdout == "seeded from the host"
        assert "a.txt" in box.run("ls /team").stdout.split()
        box.run("echo via-langsmith > /data/ls.txt")
        eventually("written through LangSmith", lambda: s3_object(stores, "ls.txt") is not None)
        assert s3_object(stores, "ls.txt") == b"via-langsmith\n"
        refused = box.run("echo x > /team/x.txt", timeout=60)
        assert refused.exit_code != 0 and "Read-only file system" in refused.stderr
        stores.no_keys_in(box.run(EVERY_ENV).stdout + box.run(MOUNT_FILES).stdout)


def test_langsmith_async_s3_and_gcs_mounts(daemon: Daemon, stores: Stores, keys: None) -> None:
    """The async client: a workspace secret for S3, an opaque service account for GCS."""

    async def main() -> tuple[str, str]:
        async with AsyncSandboxClient(
            api_endpoint=f"{daemon.url}/api/v2/sandboxes", api_key=daemon.admin_key
        ) as client:
            config = mount_config(
                mounts=[
                    s3_mount(
                        id="s",
                        mount_path="/s3",
                        bucket=BUCKET,
                        path_style=True,
                        endpoint_url=f"https://{S3_HOST}",
                        read_only=True,
                    ),
                    gcs_mount(id="g", mount_path="/gcs", bucket=GCS_BUCKET, read_only=True),
                ],
                auth=[
                    {
                        "type": "aws",
                        "aws": {
                            "access_key_id": workspace_secret("s3-key-id"),
                            "secret_access_key": workspace_secret("s3-secret"),
                        },
                    },
                    {
                        "type": "gcp",
                        "gcp": {"service_account_json": opaque_secret(stores.service_account)},
                    },
                ],
            )
            async with await client.sandbox(mount_config=config) as box:
                s3 = (await box.run("cat /s3/seeded.txt")).stdout
                gcs = (await box.run("cat /gcs/team/a.txt")).stdout
                return s3, gcs

    assert asyncio.run(main()) == ("seeded from the host", "team a in gcs")


def test_langsmith_mount_configs_cella_cannot_honour_are_refused(
    ls: SandboxClient, admin: Client, daemon: Daemon
) -> None:
    """Refused by name, nothing kept; the control (the same create with keys) is served
    above."""
    kept = len(admin.secrets())
    s3 = s3_mount(id="b", mount_path="/b", bucket=BUCKET)
    role = mount_config(
        mounts=[s3], auth=[{"type": "aws", "aws": {"role_arn": "arn:aws:iam::1:role/x"}}]
    )
    with pytest.raises(SandboxClientError, match="role_arn"):
        ls.create_sandbox(mount_config=role)
    # the SDK checks this one itself: cella does too, for a caller that does not
    keys = {"access_key_id": opaque_secret("AKIA"), "secret_access_key": opaque_secret("s")}
    both = mount_config(mounts=[s3], auth=[{"type": "aws", "aws": keys}])
    rule = aws_auth(access_key_id=opaque_secret("AKIA"), secret_access_key=opaque_secret("s"))
    body = {"mount_config": both, "proxy_config": proxy_config(rules=[rule])}
    sent = httpx.post(
        f"{daemon.url}/api/v2/sandboxes/boxes", json=body, headers={"X-Api-Key": daemon.admin_key}
    )
    assert sent.status_code == 422
    assert "both mount_config and proxy_config" in sent.text
    bad_sa = mount_config(
        mounts=[gcs_mount(id="g", mount_path="/g", bucket=GCS_BUCKET)],
        auth=[{"type": "gcp", "gcp": {"service_account_json": opaque_secret('{"a": 1}')}}],
    )
    with pytest.raises(SandboxClientError, match="not a service account"):
        ls.create_sandbox(mount_config=bad_sa)
    assert len(admin.secrets()) == kept
