"""The proxy's AWS signing on a request as mitmproxy hands it over (method, path, host,
headers that ignore case): the guest's signature goes, the new one checks out the way a
server checks it (botocore recomputing it from the signed headers, as moto does), and a
presigned URL is left as it came. End to end against a verifying S3 in
tests/integration/test_cloud_auth.py."""

from __future__ import annotations

import asyncio
from typing import Any

from botocore.auth import S3SigV4Auth, SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from cella.network.cloud_auth import DEFERRED, CloudAuth, CloudRules, Tokens
from cella.policy.cloud import DUMMY_AWS_ENV

KEY_ID, SECRET = "AKIAREALKEY000000001", "real/secret+key0000000000000000000000001"


class Headers(dict[str, str]):
    """Case-insensitive, as mitmproxy's are."""

    def __init__(self, items: dict[str, str]) -> None:
        super().__init__({k.lower(): v for k, v in items.items()})

    def __getitem__(self, key: str) -> str:
        return super().__getitem__(key.lower())

    def __setitem__(self, key: str, value: str) -> None:
        super().__setitem__(key.lower(), value)

    def __contains__(self, key: object) -> bool:
        return super().__contains__(str(key).lower())

    def get(self, key: str, default: Any = None) -> Any:
        return super().get(key.lower(), default)

    def pop(self, key: str, default: Any = None) -> Any:
        return super().pop(key.lower(), default)


class Request:
    def __init__(self, method: str, host: str, path: str, headers: dict[str, str]) -> None:
        self.method, self.host, self.path = method, host, path
        self.host_header = host
        self.headers = Headers({"host": host, **headers})
        self.raw_content = b""


RULES = CloudRules.from_json(
    {
        "aws": [
            {
                "hosts": ["*.amazonaws.com"],
                "access_key_id": KEY_ID,
                "secret_access_key": SECRET,
                "secrets": ["id", "key"],
            }
        ]
    }
)


def head(req: Request, metadata: dict[str, Any] | None = None) -> list[str]:
    async def reach(host: str, port: int) -> Any:
        raise AssertionError("no token endpoint here")

    names, _ = asyncio.run(
        CloudAuth(Tokens(lambda: None)).head(
            req, RULES, {} if metadata is None else metadata, reach
        )
    )
    return names


def verifies(req: Request, auth: type[SigV4Auth], body: bytes = b"") -> bool:
    """The server's check: recompute from the headers the signature names."""
    header = req.headers["authorization"]
    signed = header.partition("SignedHeaders=")[2].partition(",")[0].split(";")
    scope = header.partition("Credential=")[2].partition(",")[0].split("/")
    assert scope[0] == KEY_ID
    again = AWSRequest(
        method=req.method,
        url=f"https://{req.host}{req.path}",
        data=body,
        headers={k: req.headers[k] for k in signed},
    )
    again.context["timestamp"] = req.headers["x-amz-date"]
    signer = auth(Credentials(KEY_ID, SECRET), scope[3], scope[2])
    expected = signer.signature(
        signer.string_to_sign(again, signer.canonical_request(again)), again
    )
    return header.endswith(f"Signature={expected}")


def test_a_guest_signature_is_replaced_by_the_proxys() -> None:
    guest = {
        "Authorization": f"AWS4-HMAC-SHA256 Credential={DUMMY_AWS_ENV['AWS_ACCESS_KEY_ID']}"
        "/20260101/eu-west-1/s3/aws4_request, SignedHeaders=host, Signature=00",
        "X-Amz-Date": "20260101T000000Z",
        "X-Amz-Security-Token": "guess",
        "x-amz-content-sha256": "UNSIGNED-PAYLOAD",
        "X-Amz-Meta-Owner": "agent",
    }
    req = Request("PUT", "bucket.s3.amazonaws.com", "/a%20b/c.txt?tagging", guest)
    assert head(req) == ["id", "key"]
    auth = req.headers["authorization"]
    assert "/eu-west-1/s3/aws4_request" in auth  # the guest's own scope, not the host's
    assert "x-amz-meta-owner" in auth and "x-amz-security-token" not in req.headers
    assert req.headers["x-amz-date"] != "20260101T000000Z"
    assert verifies(req, S3SigV4Auth)
    req.headers["x-amz-meta-owner"] = "someone else"  # a signed header changed on the way
    assert not verifies(req, S3SigV4Auth)


def test_a_body_is_signed_by_its_hash_once_it_has_arrived() -> None:
    req = Request("POST", "sts.amazonaws.com", "/", {"Content-Type": "text/plain"})
    metadata: dict[str, Any] = {}
    head(req, metadata)
    assert DEFERRED in metadata and "authorization" not in req.headers
    req.raw_content = b"Action=GetCallerIdentity&Version=2011-06-15"
    CloudAuth(Tokens(lambda: None)).body(req, metadata)
    assert "/us-east-1/sts/aws4_request" in req.headers["authorization"]
    assert verifies(req, SigV4Auth, req.raw_content)
    assert not verifies(req, SigV4Auth, b"Action=Something&Else=1")


def test_a_presigned_url_is_left_as_it_came() -> None:
    path = "/bucket/key?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Signature=abc"
    req = Request("GET", "s3.amazonaws.com", path, {})
    assert head(req) == [] and "authorization" not in req.headers
