"""Proxy callbacks: a sandbox's rule that asks an outside URL whether a request to some hosts
may go, and with which headers (LangSmith's proxy callbacks; runs inside `mitmdump`, so
only the stdlib, `h11` and `cryptography`, which mitmproxy brings).

The ask is a POST of JSON (`host`, `port`, `identity`, and with `full_request` the request
itself: method, URL, headers, body up to `MAX_BODY` base64'd) carrying
`X-LangSmith-Signature-JWT`: an EdDSA JWT signed with the daemon's current key (sent over
the control channel), `aud` the callback URL, `sub` `langsmith-sandbox-callback`,
`body_sha256` of the exact body, so `langsmith.sandbox.SandboxTokenVerifier.verify_callback`
accepts it against the daemon's JWKS. The answer is JSON: `allow` (false, or no answer
at all: refused), `headers` to set, `ttl_seconds` to keep it for (per sandbox, rule, host
and port; `full_request` answers are never kept). The callback URL's address is held to
the operator's boundary as a sandbox's destinations are."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import re
import secrets
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import h11
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import load_pem_private_key

from cella.policy.egress import IPAddress, Rule, host_matches, parse_rule

SUBJECT = "langsmith-sandbox-callback"
SIGNATURE_HEADER = "X-LangSmith-Signature-JWT"
MAX_BODY = 64 << 10  # of a full request sent along
MAX_ANSWER = 64 << 10
MAX_TTL = 3600.0
TOKEN_SECONDS = 60
TOKEN = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]{1,128}")  # a header's name
Resolver = Callable[[str], Awaitable[IPAddress | None]]  # a URL's host, held to the boundary


@dataclass(frozen=True)
class CallbackRule:
    hosts: tuple[Rule, ...]
    url: str
    full_request: bool = False
    timeout: float = 5.0

    @classmethod
    def of(cls, data: dict[str, Any]) -> CallbackRule:
        return cls(
            tuple(parse_rule(h) for h in data["hosts"]),
            str(data["url"]),
            bool(data.get("full_request")),
            float(data.get("timeout_seconds") or 5.0),
        )


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    headers: tuple[tuple[str, str], ...] = ()
    reason: str = ""


@dataclass
class Signing:
    kid: str
    key: Ed25519PrivateKey
    issuer: str

    @classmethod
    def of(cls, msg: dict[str, Any]) -> Signing:
        key = load_pem_private_key(msg["pem"].encode(), password=None)
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError("the signing key is not Ed25519")
        return cls(str(msg["kid"]), key, str(msg.get("issuer") or "cella"))

    def sign(self, audience: str, body: bytes) -> str:
        now = int(time.time())
        claims = {
            "iss": self.issuer,
            "aud": audience,
            "sub": SUBJECT,
            "iat": now,
            "exp": now + TOKEN_SECONDS,
            "body_sha256": hashlib.sha256(body).hexdigest(),
        }
        return self.jwt(claims)

    def workload(self, audience: str, tenant: str, sandbox: str, seconds: int) -> str:
        """A sandbox's workload identity token (JWT-SVID-like) for `audience`."""
        now = int(time.time())
        claims = {
            "iss": self.issuer,
            "sub": f"spiffe://cella/tenant/{tenant}/sandbox/{sandbox}",
            "aud": audience,
            "iat": now,
            "nbf": now,
            "exp": now + seconds,
            "jti": secrets.token_hex(16),
        }
        return self.jwt(claims)

    def jwt(self, claims: dict[str, Any]) -> str:
        header = {"alg": "EdDSA", "typ": "JWT", "kid": self.kid}
        signing_input = f"{_b64json(header)}.{_b64json(claims)}"
        signature = self.key.sign(signing_input.encode())
        return f"{signing_input}.{_b64(signature)}"


@dataclass
class Callbacks:
    """The asks of every sandbox, and the answers kept for their TTL."""

    resolve: Resolver
    signing: Signing | None = None
    _kept: dict[tuple[str, str, str, int], tuple[float, Verdict]] = field(default_factory=dict)

    def rules(self, rules: tuple[CallbackRule, ...], host: str) -> list[CallbackRule]:
        return [r for r in rules if host_matches(r.hosts, host)]

    async def ask(
        self,
        rule: CallbackRule,
        identity: dict[str, Any],
        host: str,
        port: int,
        request: dict[str, Any] | None,
    ) -> Verdict:
        """The callback's answer for a request to host:port (kept ones first)."""
        key = (identity["sandbox_id"], rule.url, host.lower(), port)
        kept = self._kept.get(key)
        if kept and not rule.full_request and kept[0] > time.monotonic():
            return kept[1]
        payload: dict[str, Any] = {"host": host, "port": port, "identity": identity}
        if rule.full_request and request is not None:
            payload["request"] = request
        body = json.dumps(payload, separators=(",", ":")).encode()
        try:
            answer = await asyncio.wait_for(self._post(rule.url, body), rule.timeout)
            verdict, ttl = _verdict(answer)
        except (OSError, ValueError, TimeoutError, h11.ProtocolError) as exc:
            return Verdict(False, reason=f"the callback {rule.url} did not answer: {exc}")
        if ttl > 0 and not rule.full_request:
            self._kept[key] = (time.monotonic() + min(ttl, MAX_TTL), verdict)
        return verdict

    async def _post(self, url: str, body: bytes) -> bytes:
        if self.signing is None:
            raise ValueError("no signing key yet")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("not an http(s) URL")
        address = await self.resolve(parts.hostname)
        if address is None:
            raise ValueError(f"{parts.hostname} is not reachable for callbacks")
        tls = ssl.create_default_context() if parts.scheme == "https" else None
        port = parts.port or (443 if tls else 80)
        reader, writer = await asyncio.open_connection(
            str(address), port, ssl=tls, server_hostname=parts.hostname if tls else None
        )
        conn = h11.Connection(h11.CLIENT)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        headers = [
            ("host", parts.netloc),
            ("content-type", "application/json"),
            ("content-length", str(len(body))),
            ("connection", "close"),
            (SIGNATURE_HEADER, self.signing.sign(url, body)),
        ]
        try:
            writer.write(conn.send(h11.Request(method="POST", target=target, headers=headers)))
            writer.write(conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
            await writer.drain()
            status, answer = 0, b""
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(await reader.read(65536))
                elif isinstance(event, h11.Response):
                    status = event.status_code
                elif isinstance(event, h11.Data):
                    answer += event.data
                    if len(answer) > MAX_ANSWER:
                        raise ValueError("the answer is too long")
                elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                    break
        finally:
            writer.close()
        if status != 200:
            raise ValueError(f"it answered {status}")
        return answer


def _verdict(answer: bytes) -> tuple[Verdict, float]:
    data = json.loads(answer)
    if not isinstance(data, dict):
        raise ValueError("the answer is not a JSON object")
    headers = data.get("headers") or {}
    if not isinstance(headers, dict):
        raise ValueError("headers is not an object")
    pairs = []
    for name, value in headers.items():
        if not isinstance(value, str) or not TOKEN.fullmatch(str(name)) or _control(value):
            raise ValueError(f"header {name!r} is not a plain header")
        pairs.append((str(name), value))
    ttl = data.get("ttl_seconds") or 0
    if not isinstance(ttl, int | float):
        raise ValueError("ttl_seconds is not a number")
    allowed = data.get("allow") is True
    reason = str(
        data.get("reason") or ("allowed by the callback" if allowed else "refused by the callback")
    )
    return Verdict(allowed, tuple(pairs) if allowed else (), reason), float(ttl)


def _control(value: str) -> bool:
    return any(c in value for c in "\r\n\0")


def full_request(
    method: str,
    url: str,
    scheme: str,
    host: str,
    path: str,
    query: str,
    headers: list[tuple[str, str]],
    body: bytes,
) -> dict[str, Any]:
    """A request as a `full_request` callback gets it (`SandboxCallbackRequest`)."""
    grouped: dict[str, list[str]] = {}
    for name, value in headers:
        grouped.setdefault(name, []).append(value)
    return {
        "method": method,
        "url": url,
        "scheme": scheme,
        "host": host,
        "path": path,
        "query": query,
        "headers": grouped,
        "body_base64": base64.b64encode(body[:MAX_BODY]).decode(),
        "body_truncated": len(body) > MAX_BODY,
    }


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _b64json(data: dict[str, Any]) -> str:
    return _b64(json.dumps(data, separators=(",", ":")).encode())
