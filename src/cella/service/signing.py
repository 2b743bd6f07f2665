"""The daemon's signing keys: Ed25519, for what others verify without sharing a secret
(download links, the user tokens sent to login-mode services). Each key is a PKCS#8 file
in `DATA_DIR/signing/` (0600) named for when it was made; the newest signs. A key's id
(`kid`) is its RFC 7638 thumbprint, so it never changes: a rotated key keeps signing
nothing but is still published (`jwks`) until its file is gone (`retire`), so tokens it
signed verify until they expire."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from cella import errors

ALGORITHM = "EdDSA"


@dataclass(frozen=True, slots=True)
class SigningKey:
    kid: str
    created: int  # nanoseconds since the epoch: the newest key signs
    private: Ed25519PrivateKey

    def pem(self) -> str:
        return self.private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ).decode()

    def jwk(self) -> dict[str, str]:
        """The public half as a JWK (RFC 8037)."""
        return {**_public_fields(self.private), "kid": self.kid, "alg": ALGORITHM, "use": "sig"}


class Signer:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._keys = self._load()
        self.on_rotate: list[Callable[[SigningKey], None]] = []  # told of each new key
        if not self._keys:
            self.rotate()

    def _load(self) -> list[SigningKey]:
        found = []
        for path in self.directory.glob("*.pem"):
            created, _, _ = path.stem.partition("-")
            private = serialization.load_pem_private_key(path.read_bytes(), password=None)
            if not isinstance(private, Ed25519PrivateKey) or not created.isdigit():
                continue  # not one of ours
            found.append(SigningKey(thumbprint(private), int(created), private))
        return sorted(found, key=lambda k: k.created)

    @property
    def keys(self) -> list[SigningKey]:
        return list(self._keys)

    @property
    def current(self) -> SigningKey:
        return self._keys[-1]

    def rotate(self) -> SigningKey:
        """A new key that signs from now on; the others stay published."""
        private = Ed25519PrivateKey.generate()
        key = SigningKey(thumbprint(private), time.time_ns(), private)
        pem = key.pem().encode()
        path = self.directory / f"{key.created}-{key.kid}.pem"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
        self._keys.append(key)
        for hook in self.on_rotate:
            hook(key)
        return key

    def retire(self, kid: str) -> None:
        """Forget a key that no longer signs: what it signed stops verifying."""
        if kid == self.current.kid:
            raise errors.Conflict("the current signing key cannot be retired; rotate first")
        for path in self.directory.glob(f"*-{kid}.pem"):
            path.unlink()
        self._keys = [k for k in self._keys if k.kid != kid]

    def jwks(self) -> dict[str, list[dict[str, str]]]:
        """Every published key's public half: what `/.well-known/jwks.json` serves."""
        return {"keys": [k.jwk() for k in self._keys]}

    def sign(self, claims: dict[str, Any]) -> str:
        """A compact JWS (EdDSA) of `claims`, naming the current key."""
        key = self.current
        return jwt.encode(claims, key.private, algorithm=ALGORITHM, headers={"kid": key.kid})

    def verify(self, token: str, *, audience: str, required: list[str]) -> dict[str, Any]:
        """The claims of a token one of these keys signed for `audience`, unexpired;
        `PermissionDenied` naming why not."""
        try:
            kid = jwt.get_unverified_header(token).get("kid")
            key = next((k for k in self._keys if k.kid == kid), None)
            if key is None:
                raise errors.PermissionDenied("the token is not signed by a key of this daemon")
            claims: dict[str, Any] = jwt.decode(
                token,
                key.private.public_key(),
                algorithms=[ALGORITHM],
                audience=audience,
                options={"require": required},
            )
        except jwt.ExpiredSignatureError:
            raise errors.PermissionDenied("the token has expired") from None
        except jwt.PyJWTError as exc:
            raise errors.PermissionDenied(f"the token is not valid: {exc}") from None
        return claims


def _public_fields(private: Ed25519PrivateKey) -> dict[str, str]:
    raw = private.public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw
    )
    return {"crv": "Ed25519", "kty": "OKP", "x": _b64(raw)}


def thumbprint(private: Ed25519PrivateKey) -> str:
    """RFC 7638: SHA-256 of the required members, sorted, without whitespace."""
    canonical = json.dumps(_public_fields(private), sort_keys=True, separators=(",", ":"))
    return _b64(hashlib.sha256(canonical.encode()).digest())


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()
