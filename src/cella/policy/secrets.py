"""Secrets in transit: every form the egress proxy sends a value in, and a stream filter
that takes those forms out of what comes back (pure, stdlib only: the proxy imports it)."""

from __future__ import annotations

import base64
import re
import urllib.parse
from collections.abc import Callable

MIN_NEEDLE = 4  # shorter forms would match everywhere (secret values are longer than this)
Needles = list[tuple[bytes, bytes]]


def secret_forms(value: str, placeholder: str, user: str = "x-access-token") -> Needles:
    """Every form of `value` the proxy itself may have sent (raw in URL, headers and body;
    URL-encoded; base64, alone and as Basic credentials, also at any offset inside longer
    base64 text), each paired with the same form of `placeholder`: what must never reach
    the guest, and what it gets instead. Longest first."""
    pairs = [(value, placeholder)]
    for quote in (urllib.parse.quote, urllib.parse.quote_plus):
        pairs.append((quote(value, safe=""), quote(placeholder, safe="")))
    for raw, mark in ((value, placeholder), (f"{user}:{value}", f"{user}:{placeholder}")):
        for b64 in (base64.b64encode, base64.urlsafe_b64encode):
            pairs.append((b64(raw.encode()).decode(), b64(mark.encode()).decode()))
            for offset in (0, 1, 2):
                pairs.append((_b64_core(raw, offset, b64), _b64_core(mark, offset, b64)))
    found: dict[bytes, bytes] = {}
    for v, m in pairs:  # a whole form wins over the same characters taken as a core
        if len(v) >= MIN_NEEDLE:
            found.setdefault(v.encode(), m.encode())
    return sorted(found.items(), key=lambda p: -len(p[0]))


def _b64_core(text: str, offset: int, b64: Callable[[bytes], bytes]) -> str:
    """The base64 characters that depend only on `text` when it sits `offset` bytes into a
    longer encoded text (the characters at both ends also carry neighbouring bits)."""
    data = b"\0" * offset + text.encode()
    encoded = b64(data).decode().rstrip("=")
    start = (offset * 4 + 2) // 3  # characters that carry bits of the padding
    end = len(data) * 4 // 3  # whole characters made of the text's own bits
    return encoded[start:end]


class Redactor:
    """Replaces needles in a stream of chunks, also across chunk boundaries (the longest form
    wins where forms overlap); called with b"" at the end, it flushes what it held back.
    Returns a list of chunks, empty while it holds data back (an empty chunk would end a
    chunked HTTP body). `count` sees every chunk as it came."""

    def __init__(self, needles: Needles, count: Callable[[bytes], object] | None = None) -> None:
        self.marks = dict(needles)
        longest_first = sorted(self.marks, key=len, reverse=True)
        self.pattern = re.compile(b"|".join(re.escape(n) for n in longest_first) or b"(?!)")
        self.keep = max((len(n) for n in self.marks), default=1) - 1
        self.carry = b""
        self.count = count

    def scrub(self, data: bytes) -> bytes:
        return self.pattern.sub(lambda m: self.marks[m.group()], data)

    def __call__(self, chunk: bytes) -> list[bytes]:
        if self.count is not None:
            self.count(chunk)
        data = self.carry + chunk
        # where a longer form could still be completed by the next chunk, wait for it
        limit = len(data) if not chunk else max(0, len(data) - self.keep)
        out, done = bytearray(), 0
        for m in self.pattern.finditer(data):
            if m.start() >= limit:
                break
            out += data[done : m.start()] + self.marks[m.group()]
            done = m.end()
        if done < limit:
            out += data[done:limit]
            done = limit
        self.carry = data[done:]
        return [bytes(out)] if out else []
