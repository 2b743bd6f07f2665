"""The daemon's signing keys (`service/signing.py`) and the pieces of a download link that
need no VM (`service/downloads.py`): keys on disk, rotation that keeps kids, the JWKS a
standard JWT library verifies against, ranges and Content-Disposition."""

from __future__ import annotations

import stat
import time
from pathlib import Path

import jwt
import pytest

from cella import errors
from cella.service.downloads import byte_range, content_disposition
from cella.service.signing import Signer


def verify_with_jwks(signer: Signer, token: str, audience: str) -> dict[str, object]:
    keys = jwt.PyJWKSet.from_dict(signer.jwks())
    kid = jwt.get_unverified_header(token)["kid"]
    key = next(k for k in keys.keys if k.key_id == kid)
    return jwt.decode(token, key, algorithms=["EdDSA"], audience=audience)  # type: ignore[no-any-return]


def test_a_key_is_made_once_kept_0600_and_found_again(tmp_path: Path) -> None:
    first = Signer(tmp_path / "signing")
    files = list((tmp_path / "signing").glob("*.pem"))
    assert len(files) == 1 and stat.S_IMODE(files[0].stat().st_mode) == 0o600
    again = Signer(tmp_path / "signing")
    assert again.current.kid == first.current.kid
    token = first.sign({"aud": "x", "sub": "s"})
    assert verify_with_jwks(again, token, "x")["sub"] == "s"


def test_the_jwks_holds_public_halves_only(tmp_path: Path) -> None:
    signer = Signer(tmp_path)
    (key,) = signer.jwks()["keys"]
    assert key["kty"] == "OKP" and key["crv"] == "Ed25519" and key["alg"] == "EdDSA"
    assert "d" not in key and key["kid"] == signer.current.kid


def test_rotation_keeps_old_kids_until_retired(tmp_path: Path) -> None:
    signer = Signer(tmp_path)
    old_token = signer.sign({"aud": "x", "sub": "old"})
    old_kid = signer.current.kid
    new = signer.rotate()
    assert new.kid != old_kid and signer.current.kid == new.kid
    assert {k["kid"] for k in signer.jwks()["keys"]} == {old_kid, new.kid}
    assert jwt.get_unverified_header(signer.sign({"aud": "x"}))["kid"] == new.kid
    # what the old key signed still verifies, by the same kid, after a restart too
    reopened = Signer(tmp_path)
    assert reopened.current.kid == new.kid
    assert verify_with_jwks(reopened, old_token, "x")["sub"] == "old"
    with pytest.raises(errors.Conflict):
        reopened.retire(new.kid)
    reopened.retire(old_kid)
    assert [k["kid"] for k in reopened.jwks()["keys"]] == [new.kid]
    with pytest.raises(errors.PermissionDenied, match="not signed by a key"):
        reopened.verify(old_token, audience="x", required=["sub"])
    assert Signer(tmp_path).jwks() == reopened.jwks()


def test_verify_refuses_a_changed_token_an_expired_one_and_another_audience(
    tmp_path: Path,
) -> None:
    signer = Signer(tmp_path)
    good = signer.sign({"aud": "x", "sub": "s", "exp": int(time.time()) + 60})
    assert signer.verify(good, audience="x", required=["sub"])["sub"] == "s"
    head, body, sig = good.split(".")
    flipped = sig[:10] + ("A" if sig[10] != "A" else "B") + sig[11:]
    with pytest.raises(errors.PermissionDenied, match="not valid"):
        signer.verify(f"{head}.{body}.{flipped}", audience="x", required=["sub"])
    with pytest.raises(errors.PermissionDenied, match="not valid"):
        signer.verify(good, audience="y", required=["sub"])
    expired = signer.sign({"aud": "x", "sub": "s", "exp": int(time.time()) - 60})
    with pytest.raises(errors.PermissionDenied, match="expired"):
        signer.verify(expired, audience="x", required=["sub"])
    other = Signer(tmp_path / "other").sign({"aud": "x", "sub": "s"})
    with pytest.raises(errors.PermissionDenied, match="not signed by a key"):
        signer.verify(other, audience="x", required=["sub"])


def test_byte_ranges() -> None:
    assert byte_range(None, 10) is None
    assert byte_range("bytes=2-4", 10) == (2, 4)
    assert byte_range("bytes=7-", 10) == (7, 9)
    assert byte_range("bytes=-3", 10) == (7, 9)
    assert byte_range("bytes=5-100", 10) == (5, 9)
    assert byte_range("bytes=0-1,4-5", 10) is None  # several: the whole file
    with pytest.raises(errors.RangeNotSatisfiable):
        byte_range("bytes=10-", 10)


def test_content_disposition_names_the_file() -> None:
    assert content_disposition("attachment", "report.csv") == (
        "attachment; filename=\"report.csv\"; filename*=UTF-8''report.csv"
    )
    odd = content_disposition("inline", 'r\u00e9sum\u00e9 "v2".pdf')
    assert odd.startswith('inline; filename="r_sum_ _v2_.pdf"')
    assert odd.endswith("filename*=UTF-8''r%C3%A9sum%C3%A9%20%22v2%22.pdf")
