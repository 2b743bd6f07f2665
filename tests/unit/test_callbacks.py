"""Proxy callbacks' pieces that need no VM (`network/callbacks.py`, `models.CallbackRule`):
the signature LangSmith's verifier checks, what an answer may say, what a rule may name."""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

import jwt
import pydantic
import pytest

from cella.models import CallbackRule
from cella.network.callbacks import SUBJECT, Signing, _verdict, full_request
from cella.service.signing import Signer


def test_a_callback_signature_is_an_eddsa_jwt_over_the_body(tmp_path: Path) -> None:
    signer = Signer(tmp_path)
    key = signer.current
    signing = Signing.of({"kid": key.kid, "pem": key.pem(), "issuer": "cella"})
    body = b'{"host":"web.test","port":80}'
    token = signing.sign("http://cb.test/ask", body)
    jwk = jwt.PyJWKSet.from_dict(signer.jwks())[key.kid]
    claims = jwt.decode(token, jwk, algorithms=["EdDSA"], audience="http://cb.test/ask")
    assert claims["sub"] == SUBJECT and claims["iss"] == "cella"
    assert claims["body_sha256"] == hashlib.sha256(body).hexdigest()
    assert jwt.get_unverified_header(token) == {"alg": "EdDSA", "typ": "JWT", "kid": key.kid}
    other = Signer(tmp_path / "other").current
    with pytest.raises(jwt.InvalidSignatureError):  # the control: another key's does not
        jwt.decode(
            token,
            jwt.PyJWK.from_dict(other.jwk()),
            algorithms=["EdDSA"],
            audience="http://cb.test/ask",
        )


def test_an_answer_allows_only_when_it_says_so_and_sets_plain_headers() -> None:
    verdict, ttl = _verdict(b'{"allow": true, "headers": {"X-Key": "k"}, "ttl_seconds": 30}')
    assert verdict.allowed and verdict.headers == (("X-Key", "k"),) and ttl == 30
    for refusal in (b'{"allow": false, "headers": {"X-Key": "k"}}', b'{"allow": "yes"}', b"{}"):
        verdict, _ = _verdict(refusal)
        assert not verdict.allowed and verdict.headers == ()
    for bad in (
        b'{"allow": true, "headers": {"X-Key": "a\\r\\nX-Evil: 1"}}',
        b'{"allow": true, "headers": {"X Key": "a"}}',
        b'{"allow": true, "headers": ["X-Key"]}',
        b'{"allow": true, "ttl_seconds": "long"}',
        b"[true]",
        b"not json",
    ):
        with pytest.raises(ValueError):
            _verdict(bad)


def test_a_full_request_goes_as_the_verifier_reads_it() -> None:
    sent = full_request(
        "POST",
        "http://web.test/a?x=1",
        "http",
        "web.test",
        "/a",
        "x=1",
        [("X-A", "1"), ("X-A", "2")],
        b"x" * (70 << 10),
    )
    assert sent["headers"] == {"X-A": ["1", "2"]} and sent["body_truncated"]
    assert len(base64.b64decode(sent["body_base64"])) == 64 << 10
    json.dumps(sent)  # as it is sent


def test_a_callback_rule_names_its_hosts_and_an_http_url() -> None:
    ok = CallbackRule(hosts=["api.example.com"], url="https://cb.example.com/ask?x=1")
    assert not ok.full_request and ok.timeout_seconds == 5
    for hosts, url in (
        (["*"], "https://cb.example.com/"),
        (["10.0.0.0/8"], "https://cb.example.com/"),
        (["api.example.com"], "ftp://cb.example.com/"),
        (["api.example.com"], "https://cb.example.com/a b"),
    ):
        with pytest.raises(pydantic.ValidationError):
            CallbackRule(hosts=hosts, url=url)
