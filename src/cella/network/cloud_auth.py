"""Cloud credentials at work in the egress proxy: AWS Signature V4 (botocore's signer) on
requests to a rule's AWS hosts, and GCP OAuth access tokens (google-auth's
service_account.Credentials, minted from the tenant's key and cached to expiry) on requests
to Google API hosts.

Runs inside mitmdump beside `mitm.py`; botocore and google-auth are installed with
mitmproxy (`install.py`). The keys never reach the guest: it signs with dummy keys (or
not at all), and the proxy drops that signature and signs again. Requests are taken as
mitmproxy gives them (`.method`, `.path`, `.host`, `.host_header`, `.headers`, `.raw_content`).
"""

from __future__ import annotations

import asyncio
import hashlib
import http.client
import json
import socket
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials
from google.auth import exceptions as google_errors
from google.auth import transport
from google.oauth2 import service_account

from cella.policy.cloud import scope_of_authorization, scope_of_host
from cella.policy.egress import IPAddress, Rule, host_matches, parse_rule

DROPPED = ("authorization", "x-amz-security-token", "x-amz-date")  # the guest's signature
SIGNED = ("host", "content-type", "content-md5")  # besides every x-amz-* header
SIGNED_STREAMING = "STREAMING-AWS4-"  # chunks signed one by one, chained to the head's
BUFFERED_LIMIT = 16 << 20  # mitmproxy's stream_large_bodies: bigger bodies stream
TOKEN_TIMEOUT = 30.0
UNSIGNED_PAYLOAD = "UNSIGNED-PAYLOAD"  # S3 takes it for a body it is not shown the hash of
PRESIGNED = "x-amz-signature="  # in a query: the URL is signed already
DEFERRED = "cella-aws"  # flow metadata: an AWS request signed once its body has arrived

# (host, port) -> the address the proxy may connect to for its own requests, or ValueError
Reach = Callable[[str, int], Awaitable[IPAddress]]


class Refused(Exception):
    """A request the proxy cannot send with the credentials it was asked to add."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class AwsKeys:
    hosts: tuple[Rule, ...]
    access_key_id: str
    secret_access_key: str
    session_token: str | None
    region: str
    service: str
    names: tuple[str, ...]  # the secrets they came from, for the decision log

    def values(self) -> list[str]:
        keys = [self.access_key_id, self.secret_access_key, self.session_token]
        return [k for k in keys if k]


@dataclass(frozen=True)
class GcpAccount:
    hosts: tuple[Rule, ...]
    secret: str
    info: str  # the service account's JSON key
    scopes: tuple[str, ...]

    def values(self) -> list[str]:
        return [str(json.loads(self.info).get("private_key", ""))]


@dataclass(frozen=True)
class CloudRules:
    """A sandbox's AWS signing and GCP token rules, with their secrets' values."""

    aws: tuple[AwsKeys, ...] = ()
    gcp: tuple[GcpAccount, ...] = ()

    @classmethod
    def from_json(cls, msg: dict[str, Any]) -> CloudRules:
        aws = tuple(
            AwsKeys(
                hosts=tuple(parse_rule(h) for h in r["hosts"]),
                access_key_id=r["access_key_id"],
                secret_access_key=r["secret_access_key"],
                session_token=r.get("session_token"),
                region=r.get("region") or "us-east-1",
                service=r.get("service") or "s3",
                names=tuple(r.get("secrets", ())),
            )
            for r in msg.get("aws", ())
        )
        gcp = tuple(
            GcpAccount(
                hosts=tuple(parse_rule(h) for h in r["hosts"]),
                secret=r["secret"],
                info=r["info"],
                scopes=tuple(r["scopes"]),
            )
            for r in msg.get("gcp", ())
        )
        return cls(aws, gcp)

    def aws_for(self, host: str) -> AwsKeys | None:
        return next((r for r in self.aws if host_matches(r.hosts, host)), None)

    def gcp_for(self, host: str) -> GcpAccount | None:
        return next((r for r in self.gcp if host_matches(r.hosts, host)), None)

    def covers(self, host: str) -> bool:
        return self.aws_for(host) is not None or self.gcp_for(host) is not None

    def secrets(self) -> list[tuple[str, str]]:
        """(name, value) of every secret value the rules hold: kept out of responses."""
        out = [pair for r in self.aws for pair in zip(r.names, r.values(), strict=False)]
        return out + [(r.secret, v) for r in self.gcp for v in r.values() if v]


# -- AWS --------------------------------------------------------------------------------


class _Signer(SigV4Auth):  # type: ignore[misc]
    """botocore's SigV4 with the payload hash given (the body may not have arrived) and S3's
    canonical path (as sent; other services normalise and encode it again)."""

    def __init__(self, keys: AwsKeys, service: str, region: str, payload: str) -> None:
        creds = Credentials(keys.access_key_id, keys.secret_access_key, keys.session_token)
        super().__init__(creds, service, region)
        self._payload = payload

    def payload(self, request: Any) -> str:
        return self._payload

    def _normalize_url_path(self, path: str) -> str:
        return path if self._service_name == "s3" else str(super()._normalize_url_path(path))


def aws_scope(keys: AwsKeys, host: str, authorization: str) -> tuple[str, str]:
    """(service, region): the guest's own signature says best, then the host name, then
    the rule."""
    return (
        scope_of_authorization(authorization) or scope_of_host(host) or (keys.service, keys.region)
    )


def sign_aws(req: Any, keys: AwsKeys, scope: tuple[str, str], payload: str) -> None:
    """Drops the guest's signature and signs `req` with `keys`: host, content type and MD5
    and every x-amz-* header are signed (what a server may be shown changed by the way,
    e.g. Accept-Encoding, is not)."""
    for name in DROPPED:
        req.headers.pop(name, None)
    chosen = {"host": req.host_header or req.host}
    for name, value in req.headers.items():
        low = name.lower()
        if (low in SIGNED or low.startswith("x-amz-")) and low != "host":
            chosen[low] = value
    sends_hash = "x-amz-content-sha256" in chosen or scope[0] == "s3"
    if sends_hash:
        chosen["x-amz-content-sha256"] = chosen.get("x-amz-content-sha256", payload)
        payload = chosen["x-amz-content-sha256"]
    url = f"https://{chosen['host']}{req.path}"
    request = AWSRequest(method=req.method, url=url, headers=chosen)
    _Signer(keys, scope[0], scope[1], payload).add_auth(request)
    for name in ("Authorization", "X-Amz-Date", "X-Amz-Security-Token", "X-Amz-Content-SHA256"):
        if name in request.headers:
            req.headers[name] = request.headers[name]


def aws_payload(req: Any, service: str) -> str | None:
    """The payload hash to sign now, or None: sign once the body has arrived (services
    other than S3 want its real hash; a body that streams through cannot wait for it)."""
    given = req.headers.get("x-amz-content-sha256")
    if given:
        if given.startswith(SIGNED_STREAMING):
            raise Refused(
                400,
                f"cella egress: a body signed chunk by chunk ({given}) cannot be signed "
                "again by the proxy; send UNSIGNED-PAYLOAD or the body's SHA-256",
            )
        return str(given)
    length = req.headers.get("content-length")
    streams = length is None and "transfer-encoding" in req.headers
    if service == "s3" or streams or (length and int(length) > BUFFERED_LIMIT):
        return UNSIGNED_PAYLOAD
    return None


# -- GCP ----------------------------------------------------------------------------------


class _Response(transport.Response):
    def __init__(self, status: int, headers: dict[str, str], data: bytes) -> None:
        self._parts = (status, headers, data)

    @property
    def status(self) -> int:
        return self._parts[0]

    @property
    def headers(self) -> dict[str, str]:
        return self._parts[1]

    @property
    def data(self) -> bytes:
        return self._parts[2]


class _PinnedRequest(transport.Request):
    """google-auth's HTTP hook: HTTPS to the address the proxy decided on for the token
    endpoint's name, verified against the proxy's upstream trust."""

    def __init__(self, address: IPAddress, cafile: str | None) -> None:
        self.address = address
        self.tls = ssl.create_default_context(cafile=cafile)

    def __call__(
        self,
        url: str,
        method: str = "GET",
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
        **_: Any,
    ) -> _Response:
        parts = urlsplit(url)
        host, port = parts.hostname or "", parts.port or 443
        try:
            raw = socket.create_connection((str(self.address), port), timeout or TOKEN_TIMEOUT)
            conn = http.client.HTTPSConnection(host, port, timeout=timeout or TOKEN_TIMEOUT)
            conn.sock = self.tls.wrap_socket(raw, server_hostname=host)
            path = parts.path + (f"?{parts.query}" if parts.query else "")
            conn.request(method, path or "/", body, headers or {})
            resp = conn.getresponse()
            data = resp.read()
            conn.close()
        except (OSError, http.client.HTTPException) as exc:
            raise google_errors.TransportError(f"{host}: {exc}") from exc  # type: ignore[no-untyped-call]
        return _Response(resp.status, dict(resp.getheaders()), data)


@dataclass
class Tokens:
    """Access tokens by (key, scopes), each minted once and used until near its expiry
    (google-auth refreshes a few minutes early)."""

    cafile: Callable[[], str | None]
    _creds: dict[tuple[str, tuple[str, ...]], Any] = field(default_factory=dict)
    _locks: dict[tuple[str, tuple[str, ...]], asyncio.Lock] = field(default_factory=dict)

    async def bearer(self, account: GcpAccount, reach: Reach) -> str:
        key = (hashlib.sha256(account.info.encode()).hexdigest(), account.scopes)
        async with self._locks.setdefault(key, asyncio.Lock()):
            creds = self._creds.get(key)
            if creds is None:
                try:
                    creds = service_account.Credentials.from_service_account_info(  # type: ignore[no-untyped-call]
                        json.loads(account.info), scopes=list(account.scopes)
                    )
                except (ValueError, TypeError) as exc:  # a key that does not load
                    raise Refused(
                        502, f"cella egress: secret {account.secret!r} cannot sign: {exc}"
                    ) from None
                self._creds[key] = creds
            if not creds.valid:
                token_uri = urlsplit(creds._token_uri)
                host, port = token_uri.hostname or "", token_uri.port or 443
                try:
                    address = await reach(host, port)
                except ValueError as exc:
                    raise Refused(502, f"cella egress: token endpoint {host}: {exc}") from None
                request = _PinnedRequest(address, self.cafile())
                try:
                    await asyncio.to_thread(creds.refresh, request)
                except google_errors.GoogleAuthError as exc:
                    raise Refused(
                        502,
                        f"cella egress: no GCP access token for {creds.service_account_email} "
                        f"from {host}: {exc}",
                    ) from None
            return str(creds.token)


# -- the addon's entry points ----------------------------------------------------------


@dataclass
class CloudAuth:
    tokens: Tokens

    async def head(
        self, req: Any, rules: CloudRules, metadata: dict[str, Any], reach: Reach
    ) -> tuple[list[str], list[str]]:
        """Credentials for a request whose head has arrived: (secret names used, values to
        keep out of responses from now on). Refused when they cannot be added."""
        aws = rules.aws_for(req.host)
        if aws is not None and PRESIGNED in req.path.partition("?")[2].lower():
            return [], []  # a presigned URL carries its own signature: sent as it is
        if aws is not None:
            scope = aws_scope(aws, req.host, req.headers.get("authorization", ""))
            payload = aws_payload(req, scope[0])
            if payload is None:
                metadata[DEFERRED] = (aws, scope)
                for name in DROPPED:  # whatever happens, not the guest's signature
                    req.headers.pop(name, None)
            else:
                sign_aws(req, aws, scope, payload)
            return list(aws.names), []
        gcp = rules.gcp_for(req.host)
        if gcp is not None:
            token = await self.tokens.bearer(gcp, reach)
            req.headers["authorization"] = f"Bearer {token}"
            return [gcp.secret], [token]
        return [], []

    def body(self, req: Any, metadata: dict[str, Any]) -> None:
        """Signs a request held for its body, with the body's own hash."""
        held = metadata.pop(DEFERRED, None)
        if held is not None:
            keys, scope = held
            sign_aws(req, keys, scope, hashlib.sha256(req.raw_content or b"").hexdigest())
