"""Safe retries: a create, fork or snapshot sent with an `Idempotency-Key` is done once.

A key is the tenant's, per route (a create's key never answers a fork), and stands for one
request body: the same key with another body is refused (409) rather than answered with
something the caller did not ask for. A retry gets what the first request made (the ids of
its sandboxes or snapshot, read again as they are now); one sent while the first still
runs waits for it and gets the same. A first request that failed leaves nothing behind, so
its retry runs afresh; so does one the daemon was stopped during (written before it runs,
never finished). Keys are kept `KEEP_SECONDS`. Gateways sharing one database say who
claimed a key (`owner`) and whether that one still lives (`alive`): a retry on another
gateway waits for the first while its gateway lives, and runs afresh once it is gone.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel

from cella import errors
from cella.store import IdempotencyRecord, Store

KEEP_SECONDS = 86400.0
MAX_KEY = 255
HEADER = "Idempotency-Key"
Work = Callable[[], Awaitable[list[str]]]
WAIT_SECONDS = 0.5  # how often a request waiting on another gateway's looks again


def body_hash(body: Any) -> str:
    """Of a request's body as validated (a model) or parsed (JSON), key order aside."""
    data = body.model_dump(mode="json") if isinstance(body, BaseModel) else body
    canon = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canon.encode()).hexdigest()


def check_key(key: str) -> str:
    if not 1 <= len(key) <= MAX_KEY or not key.isprintable() or not key.isascii():
        raise errors.InvalidArgument(
            f"{HEADER} must be 1-{MAX_KEY} printable ASCII characters (e.g. a UUID)"
        )
    return key


class Idempotency:
    def __init__(
        self,
        store: Store,
        keep_seconds: float = KEEP_SECONDS,
        owner: str | None = None,
        alive: Callable[[str], bool] | None = None,
    ) -> None:
        self.store = store
        self.keep_seconds = keep_seconds
        self.owner = owner  # this process, among those sharing the store (None: alone)
        self.alive = alive  # whether the process that claimed a key still lives
        # requests running now, by (tenant, route, key): their body's hash and outcome
        self._running: dict[tuple[str, str, str], tuple[str, asyncio.Future[list[str]]]] = {}

    async def once(
        self, tenant: str, route: str, key: str | None, body: Any, work: Work
    ) -> list[str]:
        """The ids `work` made: by running it, or, for a key seen before with this body,
        what its first request made (waiting for it while it runs)."""
        if key is None:
            return await work()
        key = check_key(key)
        digest = body_hash(body)
        name = (tenant, route, key)
        running = self._running.get(name)
        if running is not None:
            self._same_body(running[0], digest)
            return await asyncio.shield(running[1])
        now = time.time()
        self.store.expire_idempotency(now - self.keep_seconds)
        seen = self.store.idempotency(tenant, route, key)
        if seen is not None:
            self._same_body(seen.body_hash, digest)
            if seen.result is None and self._elsewhere(seen):
                seen = await self._finished_elsewhere(seen)
            if seen is not None and seen.result is not None:
                return seen.result
            # written but never finished: the daemon stopped during it; it runs again
        claim = IdempotencyRecord(tenant, route, key, digest, None, now, self.owner)
        self.store.claim_idempotency(claim)
        outcome: asyncio.Future[list[str]] = asyncio.get_running_loop().create_future()
        outcome.add_done_callback(_retrieved)
        self._running[name] = (digest, outcome)
        try:
            result = await work()
        except BaseException as exc:
            self.store.drop_idempotency(tenant, route, key)
            if isinstance(exc, asyncio.CancelledError):
                outcome.cancel()
            else:
                outcome.set_exception(exc)
            raise
        finally:
            self._running.pop(name, None)
        self.store.finish_idempotency(tenant, route, key, result)
        outcome.set_result(result)
        return result

    def _elsewhere(self, seen: IdempotencyRecord) -> bool:
        """Whether another process that still lives runs the request now."""
        other = seen.owner
        return other is not None and other != self.owner and bool(self.alive and self.alive(other))

    async def _finished_elsewhere(self, seen: IdempotencyRecord) -> IdempotencyRecord | None:
        """The key's record once the other process finished it (None: it failed, nothing
        left), or as it is when that process is gone (it runs here again)."""
        while True:
            await asyncio.sleep(WAIT_SECONDS)
            now = self.store.idempotency(seen.tenant, seen.route, seen.key)
            if now is None or now.result is not None or not self._elsewhere(now):
                return now

    @staticmethod
    def _same_body(first: str, this: str) -> None:
        if first != this:
            raise errors.Conflict(
                f"this {HEADER} was used with another request body: a retry must send the "
                "same body (use a new key for a new request)"
            )


def _retrieved(outcome: asyncio.Future[list[str]]) -> None:
    """Marks a failure read, so one no retry waited for is not logged as lost."""
    if not outcome.cancelled():
        outcome.exception()
