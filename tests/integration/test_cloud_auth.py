"""Cloud credentials the egress proxy adds, end to end: real microVMs, the real daemon and
proxy, and real verifiers on loopback addresses under AWS's and Google's names (the
operator's host table maps them): moto's S3, which checks every Signature V4 against the
keys its IAM issued, a token endpoint that checks the service account's signed JWT grant,
and a Google API that checks the bearer token. The guest sends plain requests (or signs
with the dummy keys it is given) and they succeed only because the proxy signed them; its
environment, files and outputs never hold a key. Driven through cella's SDK and the pinned
LangSmith SDK (`aws_auth`, `gcp_auth`, `env_vars`)."""

from __future__ import annotations

import asyncio
import hashlib
import http.server
import json
import secrets
import ssl
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
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
    gcp_auth,
    opaque_secret,
    proxy_config,
    workspace_secret,
)

from cella import Client, Sandbox
from cella.models import AwsSigning, GcpToken
from cella.policy.cloud import DUMMY_AWS_ENV
from tests.daemon import Daemon
from tests.netservers import (
    Recorder,
    Servers,
    TestCA,
    free_loopback_block,
    moto_key,
    start_moto,
)

pytestmark = pytest.mark.vm

S3_HOST = "s3.us-east-1.amazonaws.com"
STS_HOST = "sts.amazonaws.com"  # moto too: a service that wants the body's own hash
TOKEN_HOST = "oauth2.googleapis.com"
API_HOST = "storage.googleapis.com"
BUCKET = "cella-data"
STORE_HOST = f"{BUCKET}.store.test"  # moto again: an S3-compatible store (bucket in the name)
SCOPES = ["https://www.googleapis.com/auth/devstorage.read_only"]
GCS_OBJECT = f"https://{API_HOST}/storage/v1/b/cella-bucket/o/hello?alt=media"
EVERY_ENV = "env; cat /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n'; true"


@dataclass
class Cloud:
    ca: TestCA
    s3: str  # moto's address
    token: str  # the token endpoint's
    api: str  # the Google API stand-in's address
    key_id: str
    secret_key: str
    service_account: str  # the JSON key
    tokens_seen: Recorder
    api_seen: Recorder
    issued: list[str] = field(default_factory=list)

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


class TokenHandler(http.server.BaseHTTPRequestHandler):
    """Google's OAuth token endpoint for a service account's JWT grant: the assertion must
    be signed by the account's key, for this endpoint, with the scopes asked for."""

    recorder: Recorder
    public_key: bytes
    email: str
    issued: list[str]
    scopes: frozenset[str] = frozenset({" ".join(SCOPES)})  # what it grants
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0)).decode()
        form = dict(urllib.parse.parse_qsl(body))
        entry: dict[str, Any] = {"grant_type": form.get("grant_type")}
        try:
            assert form.get("grant_type") == "urn:ietf:params:oauth:grant-type:jwt-bearer"
            claims = jwt.decode(
                form.get("assertion", ""),
                self.public_key,
                algorithms=["RS256"],
                audience=f"https://{TOKEN_HOST}/token",
                issuer=self.email,
            )
            assert claims["scope"] in self.scopes, claims["scope"]
        except (AssertionError, jwt.PyJWTError) as exc:
            entry["refused"] = repr(exc)
            self.recorder.add(entry)
            self._send(400, {"error": "invalid_grant", "error_description": repr(exc)})
            return
        token = f"ya29.{secrets.token_urlsafe(24)}"
        self.issued.append(token)
        entry["scope"] = claims["scope"]
        self.recorder.add(entry)
        self._send(200, {"access_token": token, "expires_in": 3600, "token_type": "Bearer"})

    def _send(self, status: int, payload: dict[str, Any]) -> None:
        out = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args: Any) -> None:
        pass


class ApiHandler(http.server.BaseHTTPRequestHandler):
    """A Google API that serves an object to a bearer of a token the endpoint issued, and
    says which authorization it saw (so a leak would show)."""

    recorder: Recorder
    issued: list[str]
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        auth = self.headers.get("Authorization", "")
        ok = auth in {f"Bearer {t}" for t in self.issued}
        self.recorder.add({"path": self.path, "authorization": auth, "ok": ok})
        out = json.dumps({"object": "hello from gcs", "saw": auth} if ok else {"saw": auth})
        self.send_response(200 if ok else 401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out.encode())

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def cloud(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cloud]:
    base = tmp_path_factory.mktemp("cloud")
    prefix = free_loopback_block()
    s3, token, api = f"{prefix}.4", f"{prefix}.5", f"{prefix}.6"
    names = [S3_HOST, STS_HOST, STORE_HOST, TOKEN_HOST, API_HOST]
    ca = TestCA(base / "ca", [*names, s3, token, api])
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
            "type": "service_account",
            "project_id": "cella-test",
            "private_key_id": "k1",
            "private_key": pem,
            "client_email": email,
            "client_id": "1",
            "token_uri": f"https://{TOKEN_HOST}/token",
        }
        issued: list[str] = []
        tokens_seen = servers.start(
            TokenHandler, (token, 443), ca.server_context(),
            public_key=public, email=email, issued=issued,
        )  # fmt: skip
        api_seen = servers.start(ApiHandler, (api, 443), ca.server_context(), issued=issued)
        found = Cloud(
            ca, s3, token, api, key["AccessKeyId"], key["SecretAccessKey"], json.dumps(account),
            tokens_seen, api_seen, issued,
        )  # fmt: skip
        store = found.s3_client()
        store.create_bucket(Bucket=BUCKET)
        store.put_object(Bucket=BUCKET, Key="seeded.txt", Body=b"seeded from the host")
        yield found
    finally:
        servers.close()
        moto.kill()
        moto.wait()


@pytest.fixture(scope="module")
def daemon_settings(cloud: Cloud) -> dict[str, str]:
    hosts = {S3_HOST: cloud.s3, STS_HOST: cloud.s3, STORE_HOST: cloud.s3}
    hosts |= {TOKEN_HOST: cloud.token, API_HOST: cloud.api}
    return {
        "pool_size": "0",
        "egress_hosts": json.dumps(hosts),
        "egress_aws_hosts": json.dumps(["*.store.test"]),  # LangSmith's aws rules sign there
        "egress_upstream_ca": str(cloud.ca.cert),
    }


def run(sb: Sandbox, command: str) -> str:
    result = sb.exec(command, timeout=120)
    assert result.exit_code == 0, (command, result.stderr.decode())
    return result.stdout.decode()


def status_of(sb: Sandbox, url: str, *curl: str) -> str:
    return run(sb, f"curl -sS -o /tmp/out -w '%{{http_code}}' {' '.join(curl)} '{url}'")


def no_keys_in(text: str, cloud: Cloud) -> None:
    private_key = json.loads(cloud.service_account)["private_key"]
    assert cloud.secret_key not in text and cloud.key_id not in text
    assert private_key.splitlines()[1] not in text  # a line of the key's base64 body
    assert not any(token in text for token in cloud.issued)


def test_the_proxy_signs_for_aws_and_mints_gcp_tokens(admin: Client, cloud: Cloud) -> None:
    """cella's own API: the keys are the tenant's secrets; the guest reads and writes S3 with
    plain curl and reads a Google API object, and both work only while the rules hold."""
    admin.put_secret("aws-key-id", cloud.key_id, [S3_HOST])
    admin.put_secret("aws-secret", cloud.secret_key, [S3_HOST])
    admin.put_secret("gcp-sa", cloud.service_account, [API_HOST])
    aws = AwsSigning(access_key_id="aws-key-id", secret_access_key="aws-secret")
    gcp = GcpToken(service_account="gcp-sa", scopes=SCOPES)
    allow = [S3_HOST, API_HOST]
    with admin.create(
        allow=allow, aws=[aws], gcp=[gcp], egress_env={"AWS_REGION": "us-east-1"}
    ) as sb:
        # AWS: a plain write and read, then the SDK way (signed with the dummy keys)
        run(sb, "printf 'written by the guest' > /tmp/obj")
        url = f"https://{S3_HOST}/{BUCKET}/from-guest.txt"
        # (a typed body: moto's web server would read a form-encoded one as a form)
        put = "-X PUT -H 'Content-Type: text/plain' --data-binary @/tmp/obj"
        assert status_of(sb, url, put) == "200"
        assert run(sb, f"curl -sS '{url}'") == "written by the guest"
        sigv4 = (
            '--aws-sigv4 aws:amz:us-east-1:s3 --user "$AWS_ACCESS_KEY_ID:$AWS_SECRET_ACCESS_KEY"'
        )
        seeded = run(sb, f"curl -sS {sigv4} 'https://{S3_HOST}/{BUCKET}/seeded.txt'")
        assert seeded == "seeded from the host"
        got = cloud.s3_client().get_object(Bucket=BUCKET, Key="from-guest.txt")
        assert got["Body"].read() == b"written by the guest"  # it landed, as the guest sent it
        # GCP: two reads, one token (cached), and the server's echo of it comes back redacted
        before = len(cloud.tokens_seen.requests)
        first = json.loads(run(sb, f"curl -sS '{GCS_OBJECT}'"))
        second = json.loads(run(sb, f"curl -sS '{GCS_OBJECT}'"))
        assert first["object"] == second["object"] == "hello from gcs"
        assert first["saw"] == "Bearer [cloud-token]"
        [grant] = cloud.tokens_seen.requests[before:]
        assert grant["scope"] == " ".join(SCOPES)
        assert cloud.api_seen.requests[-1]["ok"]
        # what the guest holds: dummy keys and the rule's variable, never a real key
        env = run(sb, EVERY_ENV)
        assert f"AWS_ACCESS_KEY_ID={DUMMY_AWS_ENV['AWS_ACCESS_KEY_ID']}" in env
        assert "AWS_REGION=us-east-1" in env
        files = run(sb, "cat /tmp/out /tmp/obj; ls -la /tmp /root /home/user")
        for text in (env, files, seeded, json.dumps(first)):
            no_keys_in(text, cloud)
        # the control, same sandbox and commands: without the rules, both servers refuse
        # (TLS now passes through untouched: the guest checks the servers' own CA)
        sb.set_network(allow=allow)
        sb.files.write("/tmp/test-ca.pem", cloud.ca.cert.read_bytes())
        assert status_of(sb, url, "--cacert /tmp/test-ca.pem") == "403"
        assert status_of(sb, GCS_OBJECT, "--cacert /tmp/test-ca.pem") == "401"
        env = run(sb, "env")
        assert "AWS_ACCESS_KEY_ID" not in env and "AWS_REGION" not in env


def test_the_same_requests_from_the_host_are_refused(cloud: Cloud) -> None:
    """Without the proxy's signature the servers refuse: unsigned, or signed with the dummy
    keys the guest holds; with the real keys (the control) they answer."""
    trust = ssl.create_default_context(cafile=cloud.ca.cert)
    url = f"https://{cloud.s3}/{BUCKET}/seeded.txt"
    unsigned = httpx.get(url, headers={"Host": S3_HOST}, verify=trust)
    assert unsigned.status_code == 403
    dummy = cloud.s3_client(
        DUMMY_AWS_ENV["AWS_ACCESS_KEY_ID"], DUMMY_AWS_ENV["AWS_SECRET_ACCESS_KEY"]
    )
    with pytest.raises(ClientError) as refused:
        dummy.get_object(Bucket=BUCKET, Key="seeded.txt")
    assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
    wrong = cloud.s3_client(cloud.key_id, cloud.secret_key[::-1])
    with pytest.raises(ClientError, match="SignatureDoesNotMatch"):
        wrong.get_object(Bucket=BUCKET, Key="seeded.txt")
    real = cloud.s3_client().get_object(Bucket=BUCKET, Key="seeded.txt")
    assert real["Body"].read() == b"seeded from the host"
    api = f"https://{cloud.api}/storage/v1/b/cella-bucket/o/hello?alt=media"
    assert httpx.get(api, verify=trust).status_code == 401
    bogus = {"Authorization": "Bearer ya29.made-up"}
    assert httpx.get(api, headers=bogus, verify=trust).status_code == 401
    # the token endpoint: a grant signed by another key is refused, the account's is not
    account = json.loads(cloud.service_account)
    stranger = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    now = int(time.time())
    claims = {"iss": account["client_email"], "aud": account["token_uri"], "iat": now,
              "exp": now + 600, "scope": " ".join(SCOPES)}  # fmt: skip

    def grant(key: Any) -> httpx.Response:
        form = {"grant_type": "urn:ietf:params:oauth:grant-type:jwt-bearer",
                "assertion": jwt.encode(claims, key, algorithm="RS256")}  # fmt: skip
        return httpx.post(
            f"https://{cloud.token}/token", data=form, headers={"Host": TOKEN_HOST}, verify=trust
        )

    assert grant(stranger).status_code == 400
    issued = grant(account["private_key"])
    assert issued.status_code == 200
    good = {"Authorization": f"Bearer {issued.json()['access_token']}"}
    assert httpx.get(api, headers=good, verify=trust).status_code == 200


def test_streamed_bodies_and_bodies_signed_by_their_hash(admin: Client, cloud: Cloud) -> None:
    """A body too big to hold streams through, signed UNSIGNED-PAYLOAD (S3 takes it); a
    service other than S3 gets the body's own SHA-256 in the signature (the request waits
    for its body), which moto checks against what arrived."""
    admin.put_secret("aws-key-id", cloud.key_id, [S3_HOST])
    admin.put_secret("aws-secret", cloud.secret_key, [S3_HOST])
    aws = AwsSigning(access_key_id="aws-key-id", secret_access_key="aws-secret")
    with admin.create(allow=[S3_HOST, STS_HOST], aws=[aws]) as sb:
        digest = run(sb, "head -c 20000000 /dev/urandom > /tmp/big && sha256sum /tmp/big")
        url = f"https://{S3_HOST}/{BUCKET}/big.bin"
        put = "-X PUT -H 'Content-Type: application/octet-stream' --data-binary @/tmp/big"
        assert status_of(sb, url, put) == "200"
        got = cloud.s3_client().get_object(Bucket=BUCKET, Key="big.bin")["Body"].read()
        assert hashlib.sha256(got).hexdigest() == digest.split()[0]
        form = "Action=GetCallerIdentity&Version=2011-06-15"
        who = run(sb, f"curl -sS -X POST --data '{form}' https://{STS_HOST}/")
        assert "<Arn>arn:aws:iam::123456789012:user/agent</Arn>" in who, who
        no_keys_in(who, cloud)
        # keys that cannot give a token: a clear 502 from the proxy, naming why
        account = json.loads(cloud.service_account)
        broken = "-----BEGIN PRIVATE KEY-----\nbm90IGEga2V5\n-----END PRIVATE KEY-----\n"
        other = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        stranger = other.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ).decode()
        for name, key, why in (
            ("gcp-broken", broken, "cannot sign"),
            ("gcp-stranger", stranger, "no GCP access token for agent@"),
        ):
            admin.put_secret(name, json.dumps({**account, "private_key": key}), [API_HOST])
            gcp = GcpToken(service_account=name, scopes=SCOPES)
            sb.set_network(allow=[S3_HOST, STS_HOST, API_HOST], aws=[aws], gcp=[gcp])
            out = run(sb, f"curl -sS -w ' %{{http_code}}' '{GCS_OBJECT}'")
            assert out.endswith(" 502") and why in out, out
    dummy = boto3.client(
        "sts",
        endpoint_url=f"https://{cloud.s3}",
        region_name="us-east-1",
        aws_access_key_id=DUMMY_AWS_ENV["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=DUMMY_AWS_ENV["AWS_SECRET_ACCESS_KEY"],
        verify=str(cloud.ca.cert),
    )
    with pytest.raises(ClientError) as refused:  # the guest's own keys get nowhere
        dummy.get_caller_identity()
    assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403


@pytest.fixture(scope="module")
def ls_client(daemon: Daemon) -> Iterator[SandboxClient]:
    c = SandboxClient(api_endpoint=f"{daemon.url}/api/v2/sandboxes", api_key=daemon.admin_key)
    yield c
    c.close()


def test_langsmith_aws_and_gcp_rules(ls_client: SandboxClient, admin: Client, cloud: Cloud) -> None:
    """LangSmith's `aws_auth` (a workspace secret and an opaque value), `gcp_auth` (an
    opaque service-account key) and `env_vars`, through its own SDK."""
    admin.put_secret("LS_AWS_KEY_ID", cloud.key_id, [S3_HOST])
    off = aws_auth(
        name="off",
        access_key_id=workspace_secret("LS_AWS_KEY_ID"),
        secret_access_key=opaque_secret("not-used"),
        enabled=False,
        env_vars={"FROM_A_DISABLED_RULE": "1"},
    )

    def config(aws_enabled: bool) -> dict[str, Any]:
        return proxy_config(
            rules=[
                aws_auth(
                    access_key_id=workspace_secret("LS_AWS_KEY_ID"),
                    secret_access_key=opaque_secret(cloud.secret_key),
                    enabled=aws_enabled,
                    env_vars={"AWS_DEFAULT_REGION": "us-east-1"},
                ),
                gcp_auth(
                    service_account_json=opaque_secret(cloud.service_account),
                    scopes=SCOPES,
                    env_vars={"GOOGLE_CLOUD_PROJECT": "cella-test"},
                ),
                off,
            ],
            access_control={"allow_list": [S3_HOST, STORE_HOST, API_HOST]},
        )

    with ls_client.sandbox(name="cloud-creds", proxy_config=config(True)) as box:
        url = f"https://{S3_HOST}/{BUCKET}/from-langsmith.txt"
        put = box.run(
            f"printf 'via langsmith' | curl -sS -w '%{{http_code}}' -X PUT "
            f"-H 'Content-Type: text/plain' --data-binary @- '{url}'"
        )
        assert put.stdout.endswith("200"), put.stdout
        assert box.run(f"curl -sS '{url}'").stdout == "via langsmith"
        store = f"https://{STORE_HOST}/seeded.txt"  # signed as S3 in us-east-1
        assert box.run(f"curl -sS '{store}'").stdout == "seeded from the host"
        assert json.loads(box.run(f"curl -sS '{GCS_OBJECT}'").stdout)["object"] == "hello from gcs"
        env = box.run(EVERY_ENV).stdout
        assert "AWS_DEFAULT_REGION=us-east-1" in env and "GOOGLE_CLOUD_PROJECT=cella-test" in env
        assert "FROM_A_DISABLED_RULE" not in env
        no_keys_in(env, cloud)
        # the AWS rule disabled by an update: its variable goes, and S3 refuses the guest
        ls_client.update_sandbox("cloud-creds", proxy_config=config(False))
        env = box.run("env").stdout
        assert "AWS_DEFAULT_REGION" not in env and "GOOGLE_CLOUD_PROJECT=cella-test" in env
        box.write("/tmp/test-ca.pem", cloud.ca.cert.read_bytes())
        refused = box.run(
            f"curl -sS -o /dev/null -w '%{{http_code}}' --cacert /tmp/test-ca.pem '{url}'"
        )
        assert refused.stdout == "403"
    got = cloud.s3_client().get_object(Bucket=BUCKET, Key="from-langsmith.txt")
    assert got["Body"].read() == b"via langsmith"


def test_langsmith_rules_cella_cannot_honour_are_refused(
    ls_client: SandboxClient, daemon: Daemon, admin: Client
) -> None:
    """Refused by name, and nothing of a refused config is kept (its opaque values)."""
    kept = len(admin.secrets())
    role = proxy_config(rules=[aws_auth(role_arn="arn:aws:iam::123456789012:role/agent")])
    with pytest.raises(SandboxClientError, match=r"role_arn.*External ID"):
        ls_client.create_sandbox(proxy_config=role)
    plain = {"type": "plaintext", "value": "{}"}
    gcp = proxy_config(rules=[gcp_auth(service_account_json=plain, scopes=SCOPES)])  # type: ignore[arg-type]
    with pytest.raises(SandboxClientError, match="plaintext is not supported"):
        ls_client.create_sandbox(proxy_config=gcp)
    not_a_key = proxy_config(
        rules=[gcp_auth(service_account_json=opaque_secret('{"a": 1}'), scopes=SCOPES)]
    )
    with pytest.raises(SandboxClientError, match="not a service account"):
        ls_client.create_sandbox(proxy_config=not_a_key)

    async def role_async() -> None:
        async with AsyncSandboxClient(
            api_endpoint=f"{daemon.url}/api/v2/sandboxes", api_key=daemon.admin_key
        ) as client:
            await client.create_sandbox(proxy_config=role)

    with pytest.raises(SandboxClientError, match="role_arn"):
        asyncio.run(role_async())
    assert len(admin.secrets()) == kept
