"""What the egress proxy takes out of responses: every form it sent a secret in."""

from __future__ import annotations

import base64
import gzip
import json
import urllib.parse

from hypothesis import given
from hypothesis import strategies as st

from cella.policy.secrets import Redactor, _b64_core, secret_forms

VALUE = "tok+V4lue/of=the-secret~7c2"
MARK = "cella-secret-0123456789abcdef"


def redacted(data: bytes, step: int) -> bytes:
    r = Redactor(secret_forms(VALUE, MARK))
    pieces = [c for i in range(0, len(data), step) for c in r(data[i : i + step])]
    assert all(pieces), "an empty chunk would end a chunked body"
    return b"".join(pieces + r(b""))


def reflected() -> bytes:
    basic = base64.b64encode(f"x-access-token:{VALUE}".encode()).decode()
    page = {
        "authorization": f"Basic {basic}",
        "url": "/p?t=" + urllib.parse.quote(VALUE, safe=""),
        "form": "t=" + urllib.parse.quote_plus(VALUE),
        "raw": VALUE,
        "wrapped": base64.b64encode(json.dumps({"token": VALUE}).encode()).decode(),
        "urlsafe": base64.urlsafe_b64encode(VALUE.encode()).decode(),
    }
    return json.dumps(page).encode()


def test_every_form_is_taken_out_whatever_the_chunking() -> None:
    data = reflected()
    for step in (1, 2, 3, 7, 64, len(data)):
        out = redacted(data, step)
        assert VALUE.encode() not in out
        assert base64.b64encode(f"x-access-token:{VALUE}".encode()) not in out
        assert urllib.parse.quote(VALUE, safe="").encode() not in out
        assert b"eyJ0b2tlbiI6ICJ0b2srVjRsdWUvb2Y9dGhlLXNlY3JldH43YzIifQ" not in out
        assert MARK.encode() in out  # what the guest gets instead
        # the placeholder's Basic form, for a client that decodes it
        assert base64.b64encode(f"x-access-token:{MARK}".encode()) in out


@given(prefix=st.binary(max_size=40), suffix=st.binary(max_size=40), step=st.integers(1, 50))
def test_base64_at_any_offset_inside_longer_text(prefix: bytes, suffix: bytes, step: int) -> None:
    for b64 in (base64.b64encode, base64.urlsafe_b64encode):
        blob = b64(prefix + VALUE.encode() + suffix)
        out = redacted(blob, step)
        # none of the characters that carry only the value's bits is left
        assert _b64_core(VALUE, len(prefix) % 3, b64).encode() not in out


def test_nothing_else_changes() -> None:
    data = gzip.compress(b"unrelated " * 1000) + b"plain text"
    assert redacted(data, 13) == data
