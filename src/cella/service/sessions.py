"""Browser sessions of the web console.

Logging in with an API key gives a session token, kept by the browser in an HttpOnly
cookie: `<key id>.<expiry>.<nonce>.<signature>`, signed with this daemon's key
(`DATA_DIR/session.key`). The token names the key, not the key itself, so revoking the key
ends every session made with it, and the key is never stored in the browser. A request
that changes something and rides on the cookie must also carry the session's CSRF token
(derived from the session, handed to the page when it loads): another site can make the
browser send the cookie, but cannot read the token.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import time
from pathlib import Path

from cella import errors
from cella.service.keys import Keys, Principal
from cella.service.ports import load_key

LIFETIME_SECONDS = 12 * 3600


class Sessions:
    def __init__(self, keys: Keys, key_file: Path, lifetime: float = LIFETIME_SECONDS) -> None:
        self.keys = keys
        self.lifetime = lifetime
        self._key = load_key(key_file)
        self.store = keys.store

    def login(self, api_key: str) -> tuple[str, Principal]:
        """A session for the holder of `api_key` (refused as the key would be)."""
        who = self.keys.authenticate(api_key)
        expires = int(time.time() + self.lifetime)
        body = f"{who.key_id}.{expires}.{_b64(os.urandom(12))}"
        return f"{body}.{self._sign(body)}", who

    def principal(self, token: str) -> Principal:
        """The key holder a session token speaks for, while it is valid and its key is."""
        body, _, signature = token.rpartition(".")
        parts = body.split(".")
        if len(parts) != 3 or not _same(signature, self._sign(body)):
            raise errors.Unauthenticated("not a session of this daemon: log in again")
        key_id, expires, nonce = parts
        if not expires.isdigit() or int(expires) < time.time():
            raise errors.Unauthenticated("the session has expired: log in again")
        if self.store.session_ended(nonce):
            raise errors.Unauthenticated("the session was logged out: log in again")
        who = self.keys.by_id(key_id)
        if who is None:
            raise errors.Unauthenticated("the session's API key was revoked: log in again")
        return who

    def logout(self, token: str) -> None:
        """Ends the session for good (its cookie may have been copied)."""
        self.principal(token)
        _, expires, nonce = token.rpartition(".")[0].split(".")
        self.store.end_session(nonce, int(expires))

    def csrf_token(self, token: str) -> str:
        return self._sign("csrf:" + token)

    def check_csrf(self, token: str, given: str | None) -> None:
        if not given or not _same(given, self.csrf_token(token)):
            raise errors.PermissionDenied(
                "a request made with a session cookie needs its CSRF token (X-CSRF-Token)"
            )

    def _sign(self, text: str) -> str:
        return _b64(hmac.new(self._key, text.encode(), hashlib.sha256).digest())


def _same(given: str, expected: str) -> bool:
    """Constant-time comparison of any text (non-ASCII included) with what is expected."""
    return hmac.compare_digest(given.encode(errors="surrogatepass"), expected.encode())


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()
