"""Secret values sealed at rest: AES-256-GCM under a key kept out of the database.

The key is 32 random bytes in a file of its own (0600, `secrets_key_file`, by default next to
the database but never in it), or comes from a command (`secrets_key_command`, e.g. one
that asks a KMS) that prints it base64-encoded. Each value is bound to its tenant and name
(associated data), so a sealed value copied onto another row does not open. Rotation seals
every value under a new key in one transaction; the new key is written to
`<key file>.next` first and moved over the old one after the commit, so a crash at any
point leaves a key that opens what the database holds (`KeyFile.load` finishes a rotation
it finds half done).
"""

from __future__ import annotations

import base64
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from cella import errors

PREFIX = "sealed:v1:"
KEY_BYTES = 32


class Sealer:
    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise errors.HostError(f"a secrets key is {KEY_BYTES} bytes, this one {len(key)}")
        self._aead = AESGCM(key)

    @staticmethod
    def is_sealed(value: str) -> bool:
        return value.startswith(PREFIX)

    def seal(self, value: str, owner: str) -> str:
        nonce = os.urandom(12)
        sealed = self._aead.encrypt(nonce, value.encode(), owner.encode())
        return PREFIX + base64.b64encode(nonce + sealed).decode()

    def open(self, sealed: str, owner: str) -> str:
        if not self.is_sealed(sealed):
            raise errors.HostError(f"the secret {owner} is not sealed")
        raw = base64.b64decode(sealed.removeprefix(PREFIX))
        try:
            return self._aead.decrypt(raw[:12], raw[12:], owner.encode()).decode()
        except InvalidTag:
            raise errors.HostError(
                f"the secret {owner} does not open with this secrets key (a wrong key file, "
                "or a value moved between rows)"
            ) from None


class SealedValues(Protocol):
    """What sealing asks of a database holding sealed values (`cella.store.Store`)."""

    def seal_with(self, sealer: Sealer) -> None: ...

    def opens_with(self, sealer: Sealer) -> bool: ...

    def reseal(self, new: Sealer) -> int: ...


def new_key() -> bytes:
    return AESGCM.generate_key(bit_length=KEY_BYTES * 8)


class KeyFile:
    """The secrets key in a 0600 file, made on first use."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.next = path.with_name(path.name + ".next")

    def load(self, opens: Callable[[Sealer], bool]) -> Sealer:
        """The key that opens the database's values (`opens`), finishing a rotation that
        stopped after its commit."""
        if self.next.exists():
            candidate = Sealer(self.next.read_bytes())
            if opens(candidate):
                self.next.replace(self.path)
                return candidate
            self.next.unlink()  # the rotation did not commit: the old key holds
        if not self.path.exists():
            _write_private(self.path, new_key())
        return Sealer(self.path.read_bytes())

    def rotate(self, store: SealedValues) -> int:
        """Every value of `store` under a new key; returns how many."""
        key = new_key()
        _write_private(self.next, key)
        resealed = store.reseal(Sealer(key))  # one transaction: all under the new key, or none
        self.next.replace(self.path)
        return resealed


def rotate(keys: KeyFile | None, store: SealedValues) -> int:
    """`cella secret rotate-key` for a daemon or a gateway holding `store`."""
    if keys is None:
        raise errors.InvalidArgument(
            "the secrets key comes from secrets_key_command: rotate it there"
        )
    return keys.rotate(store)


def seal_store(store: SealedValues, key_file: Path, command: str | None) -> KeyFile | None:
    """Seals `store`'s secrets under the configured key: from `command` if given, else from
    `key_file` (made on first use). Returns the key file (None: the command's key)."""
    if command:
        store.seal_with(key_from_command(command))
        return None
    keys = KeyFile(key_file)
    store.seal_with(keys.load(store.opens_with))
    return keys


def key_from_command(command: str) -> Sealer:
    """The key printed (base64) by an operator's command, e.g. one that asks a KMS."""
    done = subprocess.run(command, shell=True, capture_output=True, timeout=60, check=False)
    if done.returncode != 0:
        raise errors.HostError(f"secrets_key_command exited {done.returncode}")
    return Sealer(base64.b64decode(done.stdout.strip()))


def _write_private(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    tmp.replace(path)
